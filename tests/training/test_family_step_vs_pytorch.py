"""The training step of each model family against an independent reference: a small random Llama / Qwen2 /
StarCoder2 of transformers' own class, imported with tools/convert_checkpoint.py --from-hf and trained by our loop
(DeepSpeed ZeRO-2, gradient accumulation, AdamW with decay / no-decay groups, active clipping, warm-up then cosine),
follows the same model trained by the plain PyTorch loop of test_step_vs_pytorch.py: the loss and grad norm at every
iteration, and afterwards every parameter (our final checkpoint exported back with --to-hf), within 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_step_vs_pytorch import (
    BETAS,
    CLIP,
    EPS,
    GLOBAL_BATCH,
    ITERS,
    LR,
    MICRO_BATCH,
    MIN_LR,
    SEQ,
    WARMUP,
    WEIGHT_DECAY,
    global_batches,
    megatron_lr,
    record_batches_and_train,
)

from tests.harness import load_tool, metrics_records, run_distributed, tiny_model_args

TOL = 1e-5  # relative on the loss and grad norm; absolute on the parameters (their scale: ~0.05)
ROPE = ("--position-embedding-type", "rope", "--no-top-query-layer")
# transformers class, its config, our flags for the same model
FAMILIES = {
    "llama": ("LlamaForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True, rope_theta=10000.0,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0}),
              (*ROPE, "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--ffn-hidden-size", "64",
               "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2",
               "--rope-scaling", "linear", "--rope-scaling-factor", "2")),
    "qwen2": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-6,
                                       tie_word_embeddings=False, rope_theta=1000000.0),
              (*ROPE, "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--ffn-hidden-size", "64",
               "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention", "--num-query-groups", "2",
               "--rotary-base", "1000000", "--untie-embeddings-and-output-weights")),
    "starcoder2": ("Starcoder2ForCausalLM", dict(num_key_value_heads=2, intermediate_size=128, norm_epsilon=1e-5,
                                                 tie_word_embeddings=True, rope_theta=10000.0, sliding_window=8,
                                                 use_bias=True, residual_dropout=0.0, embedding_dropout=0.0),
                   (*ROPE, "--activation", "gelu_tanh", "--group-query-attention", "--num-query-groups", "2",
                    "--window-size", "8")),
}


def hf_model(family):
    import transformers

    from codegeex_train.tokenization.tokenizer import default_tokenizer

    cls_name, fields, _ = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    vocab = math.ceil(default_tokenizer().vocab_size / 128) * 128  # no padding logits in the softmax
    config = cls.config_class(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=SEQ, attention_dropout=0.0, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None, **fields)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: perturb all so each mapping matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"step_{family}")
    hf_model(family).save_pretrained(root / "hf")
    load_tool("convert_checkpoint").main(["--from-hf", str(root / "hf"), "--save", str(root / "ckpt"),
                                          "--tensor-model-parallel-size", "2"])
    return family, root


def train_ours(save, data, ckpt, family):
    argv = [*tiny_model_args(seq_length=SEQ, max_position_embeddings=SEQ), *FAMILIES[family][2],
            "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
            "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(ITERS), "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP),
            "--lr-decay-style", "cosine", "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP),
            "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS),
            "--zero-stage", "2", "--data-path", data, "--split", "100,0,0", "--seed", "7", "--log-interval", "1",
            "--eval-interval", "1000", "--load", str(ckpt), "--save", str(save), "--no-progress-bar",
            "--num-workers", "0"]
    per_rank = run_distributed(record_batches_and_train, world_size=2, tp_size=2, deadline_s=600, argv=argv)
    return metrics_records(save), per_rank


def train_reference(hf_dir, family, batches):
    """The plain loop of test_step_vs_pytorch.py for any causal LM: returns [(loss, grad_norm)] and the model."""
    import transformers

    model = getattr(transformers, FAMILIES[family][0]).from_pretrained(hf_dir).train()
    named = list(model.named_parameters())  # a tied lm_head appears once, as the embedding
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]  # biases and norms
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    out = []
    for step, text in enumerate(batches):
        inputs, labels = text[:, :-1], text[:, 1:]
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for _, p in named]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        if norm > CLIP:
            for g in grads:
                g.mul_(CLIP / (norm + 1e-6))
        for group in optimizer.param_groups:
            group["lr"] = megatron_lr(step)
        optimizer.step()
        out.append((loss.item(), norm))
    return out, model


@pytest.mark.slow
def test_family_training_matches_plain_pytorch(tmp_path, tiny_data, imported):
    from safetensors.torch import load_file

    family, root = imported
    ours, per_rank = train_ours(tmp_path / "run", tiny_data, root / "ckpt", family)
    reference, model = train_reference(root / "hf", family, global_batches(per_rank, [0]))
    assert sorted(ours) == list(range(1, ITERS + 1))
    for it, (loss, norm) in enumerate(reference, start=1):
        assert norm > CLIP, (it, norm)  # clipping is active at every step
        assert ours[it]["loss"] == pytest.approx(loss, rel=TOL), it
        assert ours[it]["grad_norm"] == pytest.approx(norm, rel=TOL), it
    load_tool("convert_checkpoint").main(["--load", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
    trained = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        trained.update(load_file(f))
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(trained) == set(expected)
    worst = max((trained[n] - expected[n]).abs().max().item() for n in expected)
    moved = max((trained[n] - p).abs().max().item() for n, p in hf_model(family).state_dict().items()
                if n in trained)
    print(f"{family}: worst parameter difference {worst:.2g} (the training moved them by up to {moved:.2g})")
    assert worst < TOL and moved > 100 * TOL
