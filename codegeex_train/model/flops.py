"""Model FLOPs per training iteration, Megatron's way (for TFLOP/s and MFU).

Two FLOPs per multiply-add; only matrix multiplies count. One layer's forward on b x s tokens, with n query heads
of d channels (h = n d), g key-value groups (kv = g d; g = n without grouped-query attention) and the MLP's inner
size f:

    QKV projection      2 * b*s*h * (h + 2 kv)   = 2 b s h^2 + 4 b s h kv
    scores Q K^T        2 * b*s*s * h            = 2 b s^2 h   (every query head: GQA shares K, not the work)
    probs x V           2 * b*s*s * h            = 2 b s^2 h
    attention output    2 * b*s*h * h            = 2 b s h^2
    MLP                 2 * b*s*h * f * k        = 2 k b s h f: k = 2 (h->f, f->h); k = 3 under SwiGLU (gate, up,
                                                   down: three h x f matrices)
    -> layer_fwd = 4 b s h^2 + 4 b s h kv + 4 b s^2 h + 2 k b s h f
                 = 8 b s h^2 + 4 b s^2 h + 4 b s h f          (multi-head, two-matrix MLP: Megatron's 2021 formula)

This is Megatron-LM's ``num_floating_point_operations`` with its grouped-query (1 + g/n) and gated-linear (x 3/2)
factors. The attention counts all s^2 scores, as Megatron's original formula does, with or without a sliding window
(SDPA computes the masked scores too). Norms, biases and the activation are elementwise: not counted, so RMSNorm
and --disable-bias-linear change nothing. CodeGeeX's top query layer has the same matmuls as a multi-head layer
(query h->h plus key/value h->2h = QKV), so it counts as one (always multi-head). Logits: 2 b s h V with V the
padded vocabulary, the same tied or untied. Backward costs twice the forward, and activation recomputation runs the
layers' forward once more (the logits are not recomputed):

    total = 3 * (L layer_fwd + [top query layer] layer_fwd(kv = h) + logits) + [checkpointing] the layers' forward
"""

from __future__ import annotations

from codegeex_train.config.model_config import ModelConfig


def layer_forward_flops(batch_size: int, seq_length: int, hidden: int, ffn: int, kv_size: int | None = None,
                        swiglu: bool = False) -> int:
    """One layer's forward; ``kv_size``: the keys' channels g d (None: multi-head, = hidden); ``swiglu``: three
    h x ffn matrices instead of two."""
    b, s, h, f = batch_size, seq_length, hidden, ffn
    kv = h if kv_size is None else kv_size
    mlp_matrices = 3 if swiglu else 2
    return 4 * b * s * h * h + 4 * b * s * h * kv + 4 * b * s * s * h + 2 * mlp_matrices * b * s * h * f


def model_layer_forward_flops(config: ModelConfig, batch_size: int, seq_length: int, top_query: bool = False) -> int:
    """``layer_forward_flops`` of one of ``config``'s layers (``top_query``: its top query layer, multi-head)."""
    return layer_forward_flops(batch_size, seq_length, config.hidden_size, config.ffn_hidden_size,
                               config.hidden_size if top_query else config.kv_size, config.swiglu)


def model_flops_per_iteration(config: ModelConfig, batch_size: int, seq_length: int,
                              checkpoint_activations: bool = False) -> int:
    """FLOPs of forward + backward (+ recomputation) for ``batch_size`` sequences (the global batch
    for per-iteration TFLOP/s; divide by world size and time for per-GPU throughput)."""
    layers = config.num_layers * model_layer_forward_flops(config, batch_size, seq_length)
    if config.top_query_layer:
        layers += model_layer_forward_flops(config, batch_size, seq_length, top_query=True)
    logits = 2 * batch_size * seq_length * config.hidden_size * config.padded_vocab_size
    return 3 * (layers + logits) + (layers if checkpoint_activations else 0)
