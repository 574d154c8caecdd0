"""Model FLOPs per training iteration, Megatron's way (for TFLOP/s and MFU).

Two FLOPs per multiply-add; only matrix multiplies count. One layer's forward on b x s tokens:

    QKV projection      2 * b*s*h * 3h   = 6 b s h^2
    scores Q K^T        2 * b*s*s * h    = 2 b s^2 h
    probs x V           2 * b*s*s * h    = 2 b s^2 h
    attention output    2 * b*s*h * h    = 2 b s h^2
    MLP                 2 * 2 * b*s*h*f  = 4 b s h f
    -> layer_fwd = 8 b s h^2 + 4 b s^2 h + 4 b s h f

CodeGeeX's top query layer has the same matmuls (query h->h plus key/value h->2h = QKV), so it counts as
one more layer. Logits: 2 b s h V with V the padded vocabulary. Backward costs twice the forward, and
activation recomputation runs the layers' forward once more (the logits are not recomputed):

    total = 3 * (L' * layer_fwd + logits) + [checkpointing] L' * layer_fwd,   L' = L + top_query_layer
"""

from __future__ import annotations

from codegeex_train.config.model_config import ModelConfig


def layer_forward_flops(batch_size: int, seq_length: int, hidden: int, ffn: int) -> int:
    b, s, h, f = batch_size, seq_length, hidden, ffn
    return 8 * b * s * h * h + 4 * b * s * s * h + 4 * b * s * h * f


def model_flops_per_iteration(config: ModelConfig, batch_size: int, seq_length: int,
                              checkpoint_activations: bool = False) -> int:
    """FLOPs of forward + backward (+ recomputation) for ``batch_size`` sequences (the global batch
    for per-iteration TFLOP/s; divide by world size and time for per-GPU throughput)."""
    layers = config.num_layers + int(config.top_query_layer)
    per_layer = layer_forward_flops(batch_size, seq_length, config.hidden_size, config.ffn_hidden_size)
    logits = 2 * batch_size * seq_length * config.hidden_size * config.padded_vocab_size
    forward = layers * per_layer + logits
    return 3 * forward + (layers * per_layer if checkpoint_activations else 0)
