"""The whole training step against an independent reference: a Hugging Face GPT-2, converted with our converter and
trained by our loop (DeepSpeed ZeRO-2, gradient accumulation, AdamW with decay / no-decay groups, active clipping,
warm-up then cosine decay), follows the same GPT-2 trained by the plain PyTorch loop below, iteration by iteration.

The reference shares no code with the library: it reads the same token sequences (recorded as our loader hands them
to ``get_batch``), shifts labels itself, lets HF build positions, splits the parameter groups by name, computes the
LR schedule from Megatron's formula, and clips by hand with the norm in float64.
"""

import math

import pytest
import torch

from codegeex_train import pretrain
from tests.harness import load_tool, metrics_records, run_distributed, tiny_model_args

SEQ, ITERS, GLOBAL_BATCH, MICRO_BATCH = 32, 6, 8, 2
LR, MIN_LR, WARMUP, WEIGHT_DECAY, CLIP = 2e-3, 2e-4, 2, 0.1, 0.5
BETAS, EPS = (0.9, 0.95), 1e-4  # an eps near sqrt(v) keeps the update sensitive to the gradient's scale (clipping)
# fp32 on CPU: the two loops add the same numbers in different orders (fused QKV, per-micro-batch means, ZeRO's
# flat buffers, DP all-reduce); measured max relative differences over 6 iterations: loss 1.1e-7, grad norm 7.2e-8.
# A wrong step is far outside: skipping the clip moves iteration 3's loss by 3e-4, unshifted labels iteration 1's.
LOSS_RTOL, NORM_RTOL = 2e-6, 2e-6


def record_batches_and_train(topology, argv):
    """``pretrain.main``, returning the raw (b, s + 1) tokens of every micro-batch this rank read (as numpy arrays:
    torch tensors would travel back as shared-memory handles that die with the rank)."""
    from codegeex_train.training import engine_stage as stage

    seen, real = [], stage.get_batch

    def recording(batch, device):
        seen.append(batch["text"].numpy().copy())
        return real(batch, device)

    stage.get_batch = recording
    pretrain.main(argv)
    return seen


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """A random tiny GPT-2 (vocab = the shipped tokenizer's padded vocab, so no padding logits enter the softmax),
    saved with save_pretrained and converted by tools/convert_checkpoint.py --from-hf."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from codegeex_train.tokenization.tokenizer import default_tokenizer

    root = tmp_path_factory.mktemp("hf_step")
    vocab = math.ceil(default_tokenizer().vocab_size / 128) * 128
    config = GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, bos_token_id=None,
                        eos_token_id=None)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # HF inits biases to 0 and LayerNorms to 1/0: perturb all so each mapping matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root / "hf")
    for tp in (1, 2):
        load_tool("convert_checkpoint").main(["--from-hf", str(root / "hf"), "--save", str(root / f"ckpt_tp{tp}"),
                                              "--tensor-model-parallel-size", str(tp)])
    return root


def train_ours(save, data, ckpt, world, tp):
    argv = [*tiny_model_args(seq_length=SEQ, max_position_embeddings=SEQ), "--no-top-query-layer",
            "--activation", "gelu_tanh", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "1",
            "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(ITERS), "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP),
            "--lr-decay-style", "cosine", "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP),
            "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS),
            "--zero-stage", "2", "--data-path", data, "--split", "100,0,0", "--seed", "7", "--log-interval", "1",
            "--eval-interval", "1000", "--load", str(ckpt), "--save", str(save), "--no-progress-bar",
            "--num-workers", "0"]
    per_rank = run_distributed(record_batches_and_train, world_size=world, tp_size=tp, deadline_s=600, argv=argv)
    return metrics_records(save), per_rank


def megatron_lr(step):
    """Linear warm-up over WARMUP steps, then cosine from LR to MIN_LR at ITERS (Megatron's formula)."""
    if step <= WARMUP:
        return LR * step / WARMUP
    progress = (step - WARMUP) / (ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (LR - MIN_LR)


def train_reference(hf_dir, global_batches):
    """Plain PyTorch: per iteration the mean token loss of the global batch, its float64 gradient norm, clipping by
    hand, AdamW. Returns [(loss, grad_norm)] per iteration."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_dir).train()  # dropout is 0 anyway
    no_decay = lambda name: name.endswith(".bias") or ".ln_" in name  # noqa: E731 - biases and LayerNorms
    named = list(model.named_parameters())  # the tied lm_head appears once, as transformer.wte
    groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    out = []
    for step, text in enumerate(global_batches):
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
        # The scheduler moves after each optimizer step and starts at 0: step k (from 0) runs at the rate of k.
        for group in optimizer.param_groups:
            group["lr"] = megatron_lr(step)
        optimizer.step()
        out.append((loss.item(), norm))
    return out


def global_batches(per_rank, dp_ranks):
    """Each iteration's global batch: every DP rank's micro-batches of that step (order within a step does not
    change the mean loss)."""
    gas = GLOBAL_BATCH // (MICRO_BATCH * len(dp_ranks))
    return [torch.cat([torch.from_numpy(per_rank[r][it * gas + mb]) for r in dp_ranks for mb in range(gas)])
            for it in range(ITERS)]


@pytest.mark.parametrize("world,tp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                      pytest.param(2, 2, marks=pytest.mark.slow)], ids=["tp1dp1", "tp1dp2", "tp2dp1"])
def test_training_step_matches_plain_pytorch(tmp_path, tiny_data, hf_gpt2, world, tp):
    ours, per_rank = train_ours(tmp_path / "run", tiny_data, hf_gpt2 / f"ckpt_tp{tp}", world, tp)
    dp_ranks = list(range(0, world, tp))  # TP rank 0 of each DP rank
    assert all(len(per_rank[r]) == ITERS * GLOBAL_BATCH // (MICRO_BATCH * len(dp_ranks)) for r in dp_ranks)
    reference = train_reference(hf_gpt2 / "hf", global_batches(per_rank, dp_ranks))
    assert sorted(ours) == list(range(1, ITERS + 1))
    for it, (loss, norm) in enumerate(reference, start=1):
        assert norm > CLIP, (it, norm)  # clipping is active at every step
        assert ours[it]["loss"] == pytest.approx(loss, rel=LOSS_RTOL), it
        assert ours[it]["grad_norm"] == pytest.approx(norm, rel=NORM_RTOL), it
    assert ours[ITERS]["loss"] < ours[1]["loss"]  # the steps did move the weights
