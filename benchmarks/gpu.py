"""The GPU check (issue 21, item 2): one command, four sections, one table at the end.

  (a) bf16 vs fp32: a small CodeGeeX (top query layer on) trained 50 iterations on the same code tokens from the
      same initial weights, once in fp32 and once in bf16, both through our full training step
      (training/trainer.py train_step on a build_engine ZeRO-2 engine, as pretrain.py runs it). Reported: the
      largest |loss_bf16 - loss_fp32| / loss_fp32 over the iterations and the final losses.
  (b) fp16 dynamic loss scaling: the same model in fp16 with an initial loss scale of 2^32, so that the first
      steps overflow. Reported: the steps DeepSpeed skipped, the loss scale at every step (it must come down
      until steps apply), the applied steps and their losses.
  (c) training throughput and MFU of a ~1.3B CodeGeeX (24 layers, hidden 2048, 16 heads, vocab 50400 padded to
      52224, top query layer on, sequence 2048) in bf16 under ZeRO-2 on one GPU, without and with activation
      recomputation (--checkpoint-activations): warm-up iterations, then N timed iterations, each between two
      torch.cuda.synchronize. MFU = model FLOP/s (codegeex_train/model/flops.py, Megatron's formula, without the
      recomputed forward) / the peak (--peak-tflops), next to the project's bar (>= 50%).
  (d) generation: our KV-cached greedy decoding against Hugging Face ``generate`` on the same GPU, the same weights
      (a ~1.3B model without the top query layer converted to GPT2LMHeadModel, as benchmarks/generation.py
      does), the same left-padded prompts, batch 8, 256 new tokens.

Each section runs in a process of its own (a torch.distributed world of one: NCCL on CUDA, gloo on CPU, joined
the way pretrain.py joins it) under a wall-clock budget: a section that raises (an OOM, say) or runs out of time
shows as error/timeout rows in the table and the other sections still run. An OOM in (c) is retried once at half
the micro-batch, inside the same budget. The table is printed at the end and written as JSON and Markdown
(gpu_check.json, gpu_check.md, and one log per section under logs/) to --output-dir ($OUT when set).

    python benchmarks/gpu.py          # one GPU; bash scripts/gpu_check.sh is the same (budgets: at most 5.5 minutes)
    python benchmarks/gpu.py --sections c --c-micro-batch-size 4   # one section again, other settings
    python benchmarks/gpu.py --device cpu --smoke       # no GPU: tiny shapes, every section, about a minute

Exit status: 0 when no row is an error, a timeout or a failed check (a measurement below its bar is not a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

_STARTED = time.time()  # this process's start (a child reports its start-up: imports, CUDA, process group)
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NVIDIA's datasheet: H100 SXM and H200 SXM, BF16/FP16 Tensor Core 1,979 TFLOP/s "with sparsity", i.e. 989 dense.
# (H200 NVL: 1,671 with sparsity, 835 dense: pass --peak-tflops 835 there.)
H200_SXM_DENSE_BF16_TFLOPS = 989.0
MFU_BAR = 0.50
MFU_REFERENCE = "Megatron-core reports 41-47% on H100 for 1.7-7B models"

UNITS = ("a", "b", "c", "c-recompute", "d")  # one process each; --sections a b c d (c = both c units)
DEFAULT_BUDGETS_S = {"a": 60, "b": 45, "c": 75, "c-recompute": 70, "d": 75}  # 325 s: under 6 minutes in all
SMOKE_BUDGETS_S = {"a": 60, "b": 60, "c": 60, "c-recompute": 60, "d": 60}
ROW_KEYS = ("a.max_rel_diff", "a.final_loss", "b.skipped", "b.loss_scale", "b.applied",
            "c.tokens_per_s", "c.mfu", "c-recompute.tokens_per_s", "c-recompute.mfu",
            "d.ours", "d.hf", "d.ratio", "d.greedy")
BAD = ("error", "timeout", "FAIL")


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------

def _budget(text: str) -> tuple[str, float]:
    unit, _, seconds = text.partition("=")
    if unit not in UNITS or not seconds:
        raise argparse.ArgumentTypeError(f"expected UNIT=SECONDS with UNIT one of {', '.join(UNITS)}: {text!r}")
    return unit, float(seconds)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations (for --device cpu)")
    p.add_argument("--sections", nargs="+", choices=("a", "b", "c", "d"), default=["a", "b", "c", "d"])
    p.add_argument("--output-dir", default=None, help="where the JSON, Markdown and logs go (default: $OUT when "
                   "set, else outputs/gpu_check)")
    p.add_argument("--peak-tflops", type=float, default=H200_SXM_DENSE_BF16_TFLOPS,
                   help="the device's dense bf16 peak, TFLOP/s (default: H200 SXM, 989)")
    p.add_argument("--mfu-bar", type=float, default=MFU_BAR, help="the project's MFU bar (default 0.50)")
    p.add_argument("--budget", type=_budget, action="append", default=[], metavar="UNIT=SECONDS",
                   help=f"wall-clock budget of one unit ({', '.join(UNITS)}); defaults {DEFAULT_BUDGETS_S}")
    p.add_argument("--seed", type=int, default=1234)
    # (a) and (b): a small CodeGeeX on code tokens
    p.add_argument("--small-num-layers", type=int, default=None, help="(a, b) default 12 (smoke 2)")
    p.add_argument("--small-hidden-size", type=int, default=None, help="(a, b) default 768 (smoke 32)")
    p.add_argument("--small-seq-length", type=int, default=None, help="(a, b) default 1024 (smoke 32)")
    p.add_argument("--small-micro-batch-size", type=int, default=None, help="(a, b) default 8 (smoke 2)")
    p.add_argument("--a-iters", type=int, default=None, help="(a) iterations per precision; default 50 (smoke 6)")
    p.add_argument("--bf16-rtol", type=float, default=0.03,
                   help="(a) largest |loss_bf16 - loss_fp32| / loss_fp32 that passes (default 0.03)")
    p.add_argument("--b-iters", type=int, default=None, help="(b) fp16 iterations; default 40 (smoke 10)")
    p.add_argument("--fp16-initial-scale-power", type=int, default=None,
                   help="(b) DeepSpeed fp16.initial_scale_power; default 32 (smoke 20): the first steps overflow")
    p.add_argument("--fp16-loss-scale-window", type=int, default=None,
                   help="(b) clean steps before the scale doubles again; default 20 (smoke 8)")
    p.add_argument("--no-force-fp16-on-cpu", dest="force_fp16_on_cpu", action="store_false",
                   help="(b) on CPU, skip the section instead of forcing DeepSpeed's fp16 (which it refuses there)")
    # (c): throughput
    p.add_argument("--c-num-layers", type=int, default=None, help="(c) default 24 (smoke 2)")
    p.add_argument("--c-hidden-size", type=int, default=None, help="(c) default 2048 (smoke 64)")
    p.add_argument("--c-num-attention-heads", type=int, default=None, help="(c) default 16 (smoke 4)")
    p.add_argument("--c-seq-length", type=int, default=None, help="(c) default 2048 (smoke 64)")
    p.add_argument("--c-micro-batch-size", type=int, default=None, help="(c) without recomputation; default 8 "
                   "(smoke 2); halved once on OOM")
    p.add_argument("--c-recompute-micro-batch-size", type=int, default=None,
                   help="(c) with recomputation; default 8 (smoke 2); halved once on OOM")
    p.add_argument("--c-num-microbatches", type=int, default=None,
                   help="(c) micro-batches per optimizer step (gradient accumulation); default 4 (smoke 2)")
    p.add_argument("--c-warmup-iters", type=int, default=None, help="(c) default 3 (smoke 1)")
    p.add_argument("--c-iters", type=int, default=None, help="(c) timed iterations; default 8 (smoke 2)")
    # (d): generation
    p.add_argument("--d-num-layers", type=int, default=None, help="(d) default 24 (smoke 2)")
    p.add_argument("--d-hidden-size", type=int, default=None, help="(d) default 2048 (smoke 64)")
    p.add_argument("--d-num-attention-heads", type=int, default=None, help="(d) default 16 (smoke 4)")
    p.add_argument("--d-batch-size", type=int, default=None, help="(d) prompts per call; default 8 (smoke 3)")
    p.add_argument("--d-new-tokens", type=int, default=None, help="(d) default 256 (smoke 8)")
    p.add_argument("--d-prompt-lengths", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="(d) prompt lengths spread over [MIN, MAX]; default 64 256 (smoke 4 12)")
    p.add_argument("--d-reps", type=int, default=None, help="(d) timed runs of each, interleaved; default 2 (smoke 1)")
    p.add_argument("--d-dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="(d) weights and activations of both; default bf16 on CUDA, fp32 on CPU")
    # tests only
    p.add_argument("--inject-error", action="append", default=[], choices=UNITS, help=argparse.SUPPRESS)
    p.add_argument("--inject-hang", action="append", default=[], choices=UNITS, help=argparse.SUPPRESS)
    p.add_argument("--inject-oom", action="append", default=[], choices=("c", "c-recompute"), help=argparse.SUPPRESS)
    # internal: one unit in this process
    p.add_argument("--child", choices=UNITS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-state", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-deadline", type=float, default=None, help=argparse.SUPPRESS)
    return p


# Shapes and iteration counts: FULL on a GPU, SMOKE (--smoke) on a CPU; any flag given wins.
FULL = {
    "small_num_layers": 12, "small_hidden_size": 768, "small_seq_length": 1024, "small_micro_batch_size": 8,
    "a_iters": 50, "b_iters": 40, "fp16_initial_scale_power": 32, "fp16_loss_scale_window": 20,
    "c_num_layers": 24, "c_hidden_size": 2048, "c_num_attention_heads": 16, "c_seq_length": 2048,
    "c_micro_batch_size": 8, "c_recompute_micro_batch_size": 8, "c_num_microbatches": 4, "c_warmup_iters": 3,
    "c_iters": 8, "d_num_layers": 24, "d_hidden_size": 2048, "d_num_attention_heads": 16, "d_batch_size": 8,
    "d_new_tokens": 256, "d_prompt_lengths": (64, 256), "d_reps": 2,
}
SMOKE = {
    "small_num_layers": 2, "small_hidden_size": 32, "small_seq_length": 32, "small_micro_batch_size": 2,
    "a_iters": 6, "b_iters": 10, "fp16_initial_scale_power": 20, "fp16_loss_scale_window": 8,
    "c_num_layers": 2, "c_hidden_size": 64, "c_num_attention_heads": 4, "c_seq_length": 64,
    "c_micro_batch_size": 2, "c_recompute_micro_batch_size": 2, "c_num_microbatches": 2, "c_warmup_iters": 1,
    "c_iters": 2, "d_num_layers": 2, "d_hidden_size": 64, "d_num_attention_heads": 4, "d_batch_size": 3,
    "d_new_tokens": 8, "d_prompt_lengths": (4, 12), "d_reps": 1,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    a = parser().parse_args(argv)
    for key, value in (SMOKE if a.smoke else FULL).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.d_dtype is None:
        a.d_dtype = "bf16" if a.device == "cuda" else "fp32"
    return a


# --------------------------------------------------------------------------------------------------------------------
# The child: one unit, in a torch.distributed world of one
# --------------------------------------------------------------------------------------------------------------------

class State:
    """What a unit has measured so far, rewritten atomically after every change (a timeout keeps the partial data)."""

    def __init__(self, path: str):
        self.path = path
        self.doc: dict = {"data": {}, "notes": []}
        self.flush()

    def set(self, **values) -> None:
        self.doc["data"].update(values)
        self.flush()

    def note(self, text: str) -> None:
        self.doc["notes"].append(text)
        print(f"note: {text}", flush=True)
        self.flush()

    def flush(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f)
        os.replace(tmp, self.path)


class Deadline:
    def __init__(self, at: float | None):
        self.at = at

    def passed(self) -> bool:
        return self.at is not None and time.time() > self.at


def sync(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def world_of_one():
    """Join a one-rank process group as pretrain.py does (NCCL on CUDA, gloo on CPU) and build the topology."""
    import torch

    from codegeex_train import pretrain
    from codegeex_train.config.arguments import (
        Args,
        DataConfig,
        LoggingConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )
    from codegeex_train.config.model import ModelConfig
    from codegeex_train.distributed.layout import Layout
    from codegeex_train.distributed.topology import ParallelDims

    if os.environ.get("DS_ACCELERATOR") != "cpu" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
    args = Args(ModelConfig(), ParallelConfig(distributed_timeout_minutes=5.0), TrainConfig(), OptimConfig(),
                DataConfig(), LoggingConfig())
    return pretrain.init_distributed(args, Layout(ParallelDims(1, 1), 1, 1))


def build_run(topology, device, model_config, *, precision: str, seq_length: int, micro_batch_size: int,
              num_microbatches: int, train_iters: int, seed: int, checkpoint_activations: bool = False,
              ds_user: dict | None = None, lr: float = 6e-4):
    """Model, ZeRO-2 engine and the trainer's Run, wired as pretrain.py wires them (PP 1, TP 1, DP 1)."""
    from codegeex_train.config.arguments import (
        Args,
        DataConfig,
        LoggingConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )
    from codegeex_train.config.deepspeed import build_deepspeed_config
    from codegeex_train.distributed.layout import Layout
    from codegeex_train.model.codegeex import CodeGeeXModel
    from codegeex_train.model.flops import model_flops_per_iteration
    from codegeex_train.pipeline import mark_shared_embedding_copy
    from codegeex_train.tensor_parallel import model_parallel_seed
    from codegeex_train.training.engine import build_engine
    from codegeex_train.training.trainer import Run

    train = TrainConfig(micro_batch_size=micro_batch_size, seq_length=seq_length, train_iters=train_iters, seed=seed,
                        bf16=precision == "bf16", fp16=precision == "fp16", zero_stage=2,
                        checkpoint_activations=checkpoint_activations)
    optim = OptimConfig(lr=lr, lr_decay_style="constant", clip_grad=1.0)
    args = Args(model_config, ParallelConfig(), train, optim, DataConfig(), LoggingConfig())
    layout = Layout(topology.dims, micro_batch_size, num_microbatches, (range(model_config.num_layers),))
    ds_config = build_deepspeed_config(args, layout, ds_user)
    tracker = model_parallel_seed(seed, topology.tp_rank, device)
    model = CodeGeeXModel(model_config, topology.tp_group, tracker, seed=seed,
                          checkpoint_activations=checkpoint_activations, device=device)
    mark_shared_embedding_copy(model, topology)
    engine = build_engine(model, optim, train_iters, ds_config, topology)
    flops = model_flops_per_iteration(model_config, layout.global_batch_size, seq_length, checkpoint_activations)
    return Run(args, layout, topology, engine, tracker, device, None, flops)


def weights_dtype(run) -> str:
    """The dtype the engine computes in (DeepSpeed casts the module for bf16/fp16; the fp32 master copy is ZeRO's)."""
    return str(next(run.engine.module.parameters()).dtype).removeprefix("torch.")


def free(device) -> None:
    """Collect what the caller dropped (an engine) and hand its CUDA memory back."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def small_model(a, vocab_size: int):
    from codegeex_train.config.model import ModelConfig

    h = a.small_hidden_size
    heads = h // 64 if h >= 64 else 4  # head size 64 (768 -> 12 heads, as GPT-2 small)
    return ModelConfig(num_layers=a.small_num_layers, hidden_size=h, num_attention_heads=heads,
                       max_position_embeddings=a.small_seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                       activation="fast_gelu", top_query_layer=True, vocab_size=vocab_size)


def code_batches(a, count: int):
    """``count`` micro-batches (b, s + 1) of consecutive tokens of this Python's stdlib source, tokenized with the
    shipped tokenizer: real code, so the loss falls over the iterations. Returns (batches, vocab size)."""
    import torch

    from codegeex_train.data.default_corpus import default_corpus_files
    from codegeex_train.data.tokenizer import default_tokenizer

    tokenizer = default_tokenizer()
    b, s = a.small_micro_batch_size, a.small_seq_length
    need = count * b * (s + 1)
    ids: list[int] = []
    for path in default_corpus_files():
        ids += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")) + [tokenizer.eod]
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise RuntimeError(f"the stdlib corpus gave {len(ids)} tokens, {need} needed")
    stream = torch.tensor(ids[:need], dtype=torch.long).view(count, b, s + 1)
    return list(stream), tokenizer.vocab_size


def train_losses(run, batches, deadline: Deadline, on_step) -> int:
    """One optimizer step per micro-batch (num_microbatches 1) through the trainer's train_step."""
    from codegeex_train.training.trainer import train_step

    for i, text in enumerate(batches):
        if deadline.passed():
            return i
        loss = train_step(run, iter([{"text": text}]))
        on_step(i, loss.item())
    return len(batches)


def unit_a(a, state: State, topology, device, deadline: Deadline) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: no TF32 in the reference
    torch.backends.cudnn.allow_tf32 = False
    batches, vocab = code_batches(a, a.a_iters)
    config = small_model(a, vocab)
    state.set(iters_planned=a.a_iters, shape=f"{config.num_layers} layers x {config.hidden_size}, "
              f"{config.num_attention_heads} heads, vocab {config.padded_vocab_size}, seq {a.small_seq_length}, "
              f"micro-batch {a.small_micro_batch_size}")
    for precision in ("fp32", "bf16"):
        run = build_run(topology, device, config, precision=precision, seq_length=a.small_seq_length,
                        micro_batch_size=a.small_micro_batch_size, num_microbatches=1, train_iters=a.a_iters,
                        seed=a.seed)
        state.set(**{f"{precision}_weights": weights_dtype(run)})
        losses: list[float] = []

        def record(i, loss, losses=losses, precision=precision):
            losses.append(loss)
            state.set(**{f"{precision}_losses": losses})

        start = time.perf_counter()
        done = train_losses(run, batches, deadline, record)
        state.set(**{f"{precision}_seconds": time.perf_counter() - start})
        run = None  # the engine goes before the next one is built
        free(device)
        if done < len(batches):
            state.note(f"{precision}: stopped after {done} of {len(batches)} iterations by the section's budget")
            return


def unit_b(a, state: State, topology, device, deadline: Deadline) -> None:
    if device.type == "cpu":
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.is_fp16_supported():  # this CPU has AVX-512 FP16 / AMX: DeepSpeed accepts fp16 as it is
            state.set(cpu_fp16="fp16 on CPU: DeepSpeed accepts it on this CPU (not forced)")
        elif not a.force_fp16_on_cpu:
            state.set(skipped="fp16 is a GPU path: DeepSpeed refuses it on this CPU (--no-force-fp16-on-cpu)")
            return
        else:
            accelerator.is_fp16_supported = lambda: True  # this process only: DeepSpeed's sanity check
            state.set(cpu_fp16="fp16 forced on CPU: DeepSpeed refuses it on this CPU (its accelerator's "
                               "is_fp16_supported patched in this process only)")
    batches, vocab = code_batches(a, a.b_iters)
    config = small_model(a, vocab)
    power = a.fp16_initial_scale_power
    user = {"fp16": {"initial_scale_power": power, "loss_scale_window": a.fp16_loss_scale_window, "hysteresis": 2,
                     "min_loss_scale": 1}}
    run = build_run(topology, device, config, precision="fp16", seq_length=a.small_seq_length,
                    micro_batch_size=a.small_micro_batch_size, num_microbatches=1, train_iters=a.b_iters,
                    seed=a.seed, ds_user=user)
    engine = run.engine
    state.set(weights=weights_dtype(run), iters_planned=a.b_iters, initial_scale_power=power,
              window=a.fp16_loss_scale_window)
    steps: list[dict] = []

    def scale() -> float:
        optimizer = engine.optimizer
        return float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 1.0)))

    skipped_before = [int(getattr(engine, "skipped_steps", 0))]
    scale_before = [scale()]

    def record(i, loss):
        skipped_now = int(getattr(engine, "skipped_steps", 0))
        steps.append({"step": i + 1, "scale": scale_before[0], "skipped": skipped_now > skipped_before[0],
                      "loss": loss})
        skipped_before[0], scale_before[0] = skipped_now, scale()
        state.set(steps=steps, final_scale=scale_before[0])

    done = train_losses(run, batches, deadline, record)
    if done < len(batches):
        state.note(f"stopped after {done} of {len(batches)} iterations by the section's budget")


def unit_name(recompute: bool) -> str:
    return "c-recompute" if recompute else "c"


def unit_c(a, state: State, topology, device, deadline: Deadline, recompute: bool) -> None:
    import torch

    from codegeex_train.config.model import ModelConfig
    from codegeex_train.model.flops import model_flops_per_iteration
    from codegeex_train.training.trainer import train_step

    mb = a.c_recompute_micro_batch_size if recompute else a.c_micro_batch_size
    nmb, s = a.c_num_microbatches, a.c_seq_length
    config = ModelConfig(num_layers=a.c_num_layers, hidden_size=a.c_hidden_size,
                         num_attention_heads=a.c_num_attention_heads, max_position_embeddings=s,
                         activation="fast_gelu", top_query_layer=True, vocab_size=1000 if a.smoke else 50400,
                         make_vocab_size_divisible_by=128 if a.smoke else 52224)
    iters = a.c_warmup_iters + a.c_iters
    state.set(micro_batch_size=mb, num_microbatches=nmb, seq_length=s, warmup=a.c_warmup_iters,
              iters_planned=a.c_iters, padded_vocab=config.padded_vocab_size,
              shape=f"{config.num_layers} layers x {config.hidden_size}, {config.num_attention_heads} heads, vocab "
                    f"{config.vocab_size} padded to {config.padded_vocab_size}, top query layer, seq {s}")
    if unit_name(recompute) in a.inject_oom and mb > 1:
        raise torch.OutOfMemoryError(f"injected out of memory at micro-batch {mb} (--inject-oom, tests only)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    run = build_run(topology, device, config, precision="bf16", seq_length=s, micro_batch_size=mb,
                    num_microbatches=nmb, train_iters=iters, seed=a.seed, checkpoint_activations=recompute)
    params = sum(p.numel() for p in run.engine.module.parameters())
    state.set(build_seconds=time.perf_counter() - start, parameters=params, weights=weights_dtype(run))
    g = torch.Generator().manual_seed(a.seed)
    data = [torch.randint(config.vocab_size, (mb, s + 1), generator=g) for _ in range(iters * nmb)]
    batches = iter({"text": t} for t in data)
    times: list[float] = []
    losses: list[float] = []
    for i in range(iters):
        if deadline.passed():
            state.note(f"stopped after {i} of {iters} iterations by the section's budget")
            break
        t0 = sync(device)
        loss = train_step(run, batches)
        t1 = sync(device)
        losses.append(loss.item())
        if i >= a.c_warmup_iters:
            times.append(t1 - t0)
        state.set(iteration_seconds=times, losses=losses)
    if not times:
        raise RuntimeError(f"no timed iteration within the budget ({len(losses)} warm-up iterations done)")
    global_batch = run.layout.global_batch_size
    seconds = sum(times) / len(times)
    model_flops = model_flops_per_iteration(config, global_batch, s, False)
    counted_flops = model_flops_per_iteration(config, global_batch, s, recompute)  # what pretrain.py logs
    peak = a.peak_tflops * 1e12
    result = {"global_batch": global_batch, "tokens_per_s": global_batch * s / seconds,
              "seconds_per_iteration": seconds,
              "median_seconds": statistics.median(times), "model_tflops": model_flops / seconds / 1e12,
              "mfu": model_flops / seconds / peak, "mfu_with_recompute_flops": counted_flops / seconds / peak,
              "losses_finite": all(math.isfinite(x) for x in losses)}
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        result["total_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
    state.set(**result)


def unit_d(a, state: State, topology, device, deadline: Deadline) -> None:
    import torch
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from codegeex_train.checkpoint import hf_gpt2_config
    from codegeex_train.checkpoint.hf_gpt2 import full_to_hf_gpt2
    from codegeex_train.config.model import ModelConfig
    from codegeex_train.generation import Generator, SamplingParams
    from codegeex_train.model.codegeex import CodeGeeXModel

    hf_logging.set_verbosity_error()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.d_dtype]
    lo, hi = a.d_prompt_lengths
    config = ModelConfig(num_layers=a.d_num_layers, hidden_size=a.d_hidden_size,
                         num_attention_heads=a.d_num_attention_heads, vocab_size=1000 if a.smoke else 50400,
                         max_position_embeddings=max(2048, hi + a.d_new_tokens) if not a.smoke else hi + a.d_new_tokens,
                         hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh", top_query_layer=False)
    start = time.perf_counter()
    ours = CodeGeeXModel(config, None, None, dtype=dtype, device=device).eval()
    hf_config = hf_gpt2_config(config)
    hf_config.bos_token_id = hf_config.eos_token_id = None  # every row generates exactly --d-new-tokens tokens
    with torch.device(device):
        hf_model = GPT2LMHeadModel(hf_config)
    hf_model = hf_model.to(dtype).eval()
    missing, unexpected = hf_model.load_state_dict(full_to_hf_gpt2(ours.state_dict(), config), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GPT-2 conversion: missing {missing}, unexpected {unexpected}")
    state.set(build_seconds=time.perf_counter() - start, dtype=a.d_dtype,
              hf_attention=getattr(hf_model.config, "_attn_implementation", None),
              shape=f"{config.num_layers} layers x {config.hidden_size}, {config.num_attention_heads} heads, vocab "
                    f"{config.vocab_size}, no top query layer")

    g = torch.Generator().manual_seed(a.seed)
    lengths = torch.linspace(lo, hi, a.d_batch_size).round().long().tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    gen = Generator(ours, None, device=device)
    new = a.d_new_tokens

    from generation import hf_generate as hf_generate_batch  # benchmarks/generation.py (the script's directory)

    def hf_generate(n_new: int) -> list[list[int]]:
        return hf_generate_batch(hf_model, prompts, n_new)

    def ours_generate(n_new: int) -> list[list[int]]:
        return gen.generate_ids(prompts, SamplingParams(max_new_tokens=n_new))

    def timed(fn):
        t0 = sync(device)
        result = fn(new)
        return sync(device) - t0, result

    ours_generate(4)  # warm-up: allocator, kernels' first calls
    hf_generate(4)
    times = {"ours": [], "hf": []}
    tokens = {}
    for rep in range(a.d_reps):  # ours, HF, HF, ours, ...: drift hits both alike
        for who in (("ours", "hf") if rep % 2 == 0 else ("hf", "ours")):
            if deadline.passed():
                state.note(f"stopped after {rep} of {a.d_reps} repetitions by the section's budget")
                break
            t, tokens[who] = timed(ours_generate if who == "ours" else hf_generate)
            times[who].append(t)
            state.set(seconds=times)
    n_tokens = len(prompts) * new
    result = {"batch": len(prompts), "new_tokens": new, "prompt_lengths": lengths}
    for who in ("ours", "hf"):
        if times[who]:
            result[f"{who}_tokens_per_s"] = n_tokens / statistics.median(times[who])
    if "ours" in tokens and "hf" in tokens:
        a_rows, b_rows = tokens["ours"], tokens["hf"]
        prefixes = []
        for x, y in zip(a_rows, b_rows):
            k = 0
            while k < min(len(x), len(y)) and x[k] == y[k]:
                k += 1
            prefixes.append(k)
        result.update(rows_identical=sum(x == y for x, y in zip(a_rows, b_rows)),
                      common_prefix=prefixes, lengths_ok=all(len(x) == new for x in a_rows + b_rows))
    state.set(**result)


def child_main(a) -> int:
    state = State(a.child_state)
    deadline = Deadline(a.child_deadline)
    try:
        import torch

        state.doc["torch"] = torch.__version__
        topology, device = world_of_one()
        import deepspeed

        state.doc["deepspeed"] = deepspeed.__version__
        state.doc["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        state.doc["backend"] = torch.distributed.get_backend()
        state.doc["startup_seconds"] = time.time() - _STARTED
        state.flush()
        if a.child in a.inject_error:
            raise RuntimeError(f"injected failure in unit {a.child} (--inject-error, tests only)")
        if a.child in a.inject_hang:
            state.set(hanging=True)
            time.sleep(3600)
        if a.child == "a":
            unit_a(a, state, topology, device, deadline)
        elif a.child == "b":
            unit_b(a, state, topology, device, deadline)
        elif a.child in ("c", "c-recompute"):
            unit_c(a, state, topology, device, deadline, recompute=a.child == "c-recompute")
        else:
            unit_d(a, state, topology, device, deadline)
        state.doc["done"] = True
        state.flush()
        return 0
    except BaseException as e:  # noqa: BLE001 - reported in the table
        traceback.print_exc()
        message = f"{type(e).__name__}: {e}".strip().splitlines()
        state.doc["error"] = message[0][:400] if message else type(e).__name__
        state.doc["oom"] = type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
        state.flush()
        return 1
    finally:
        with contextlib.suppress(Exception):  # the process ends anyway
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------------
# The parent: units in turn, each in a process of its own under its budget, then one table
# --------------------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(device: str) -> dict:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu" if device == "cpu" else "cuda"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # A world of one per unit, whatever launched us.
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    return env


_RUNNING: list[subprocess.Popen] = []  # the unit's process (its own session: a signal to us does not reach it)


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


def _on_signal(signum, frame) -> None:
    for proc in _RUNNING:
        _kill(proc)
    raise Interrupted(signum)


def _kill(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-400:]


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"data": {}, "notes": []}


def run_unit(unit: str, argv: list[str], a, budget: float, out_dir: Path) -> dict:
    """Run one unit in a child process within ``budget`` seconds; its state (data, notes, error) plus how it ended.
    A (c) unit that runs out of memory is retried once at half the micro-batch within the same budget."""
    start = time.monotonic()
    log_path = out_dir / "logs" / f"{unit}.log"
    state_path = out_dir / "logs" / f"{unit}.state.json"
    extra: list[str] = []
    attempts: list[dict] = []
    while True:
        remaining = budget - (time.monotonic() - start)
        if state_path.exists():
            state_path.unlink()
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", unit, "--child-state", str(state_path),
               "--child-deadline", str(time.time() + max(1.0, remaining - 8.0)), *extra]
        env = child_env(a.device)
        env["MASTER_PORT"] = str(free_port())
        with open(log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=str(ROOT), start_new_session=True)
            _RUNNING.append(proc)
            timed_out = False
            try:
                rc = proc.wait(timeout=max(1.0, remaining))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
                rc = proc.returncode
            except Interrupted as e:  # its process is down (_on_signal): hand up what it had measured
                e.state = _read_state(state_path)
                e.state.update(seconds=time.monotonic() - start, log=str(log_path.relative_to(out_dir)),
                               error=f"{e} while running (its process was stopped)")
                raise
            finally:
                _RUNNING.remove(proc)
        state = _read_state(state_path)
        state.update(rc=rc, seconds=time.monotonic() - start, log=str(log_path.relative_to(out_dir)))
        if timed_out:
            state["timeout"] = True
            state["error"] = f"over its {budget:.0f} s budget (killed)"
        elif rc != 0 and not state.get("error"):
            state["error"] = f"exit status {rc}: {_tail(log_path)}"
        flag = "--c-recompute-micro-batch-size" if unit == "c-recompute" else "--c-micro-batch-size"
        mb = state.get("data", {}).get("micro_batch_size")
        if (state.get("oom") and unit.startswith("c") and not attempts and mb and mb > 1
                and budget - (time.monotonic() - start) > 20):
            attempts.append({"micro_batch_size": mb, "error": state.get("error")})
            extra = [flag, str(mb // 2)]
            continue
        state["attempts"] = attempts
        return state


@dataclass
class Row:
    key: str
    check: str
    measured: str
    bar: str
    status: str
    note: str = ""


def _fmt_pow2(x: float) -> str:
    if x > 0 and float(x).is_integer() and 2 ** round(math.log2(x)) == x:
        return f"2^{round(math.log2(x))}"
    return f"{x:g}"


def _failed(state: dict, rows: list[tuple[str, str, str]]) -> list[Row]:
    """The unit's rows when it produced no result: error / timeout / skipped, with the reason."""
    if state.get("skipped_by_parent"):
        status, why = "skipped", state["skipped_by_parent"]
    elif state.get("timeout"):
        status, why = "timeout", state.get("error", "")
    else:
        status, why = "error", state.get("error") or "no result (see the log)"
    if state.get("log"):
        why += f" [log: {state['log']}]"
    return [Row(key, check, "-", bar, status, why) for key, check, bar in rows]


def _ended(state: dict) -> str:
    """Why a unit stopped short, for a row that still has partial data; '' when it finished."""
    if state.get("timeout"):
        return "timeout"
    if state.get("error"):
        return "error"
    return ""


def rows_a(state: dict, a) -> list[Row]:
    d = state.get("data", {})
    specs = [("a.max_rel_diff", "(a) bf16 vs fp32: max |dloss| / loss_fp32",
              f"<= {a.bf16_rtol:g}"),
             ("a.final_loss", "(a) final loss fp32 / bf16 (first -> last)", "both fall")]
    fp32, bf16 = d.get("fp32_losses") or [], d.get("bf16_losses") or []
    n = min(len(fp32), len(bf16))
    if n == 0:
        return _failed(state, specs)
    ended = _ended(state)
    diffs = [abs(y - x) / abs(x) for x, y in zip(fp32, bf16)]
    worst = max(range(n), key=lambda i: diffs[i])
    partial = f"; only {n} of {d.get('iters_planned')} iterations" if n < d.get("iters_planned", n) else ""
    note = (f"{n} iterations each, same seed and code tokens; worst at iteration {worst + 1}; "
            f"{d.get('shape', '')}; module weights {d.get('fp32_weights')} / {d.get('bf16_weights')}, fp32 without "
            f"TF32{partial}")
    rel = diffs[worst]
    learns = fp32[n - 1] < fp32[0] and bf16[n - 1] < bf16[0]
    return [Row(specs[0][0], specs[0][1], f"{rel:.2e}", specs[0][2],
                ended or ("pass" if rel <= a.bf16_rtol else "FAIL"), note),
            Row(specs[1][0], specs[1][1], f"{fp32[n - 1]:.4f} / {bf16[n - 1]:.4f}", specs[1][2],
                ended or ("pass" if learns else "FAIL"),
                f"fp32 {fp32[0]:.3f} -> {fp32[n - 1]:.3f}, bf16 {bf16[0]:.3f} -> {bf16[n - 1]:.3f}; "
                f"{d.get('fp32_seconds', 0):.1f} s fp32, {d.get('bf16_seconds', 0):.1f} s bf16")]


def _trajectory(scales: list[float]) -> str:
    """2^32 x2 -> 2^31 -> ... : runs of equal scales, at most 12 runs shown."""
    runs: list[list] = []
    for x in scales:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    parts = [_fmt_pow2(x) + (f" x{k}" if k > 1 else "") for x, k in runs]
    if len(parts) > 12:
        parts = parts[:6] + ["..."] + parts[-5:]
    return " -> ".join(parts)


def rows_b(state: dict, a) -> list[Row]:
    d = state.get("data", {})
    power = d.get("initial_scale_power", a.fp16_initial_scale_power)
    specs = [("b.skipped", "(b) fp16: steps skipped by dynamic loss scaling", f">= 1, from step 1 (scale 2^{power})"),
             ("b.loss_scale", "(b) fp16: loss scale per step", f"falls from 2^{power} until steps apply"),
             ("b.applied", "(b) fp16: applied steps, loss first -> last", ">= 1 applied, finite, falling")]
    if d.get("skipped"):
        return [Row(k, c, "-", b, "skipped", d["skipped"]) for k, c, b in specs]
    steps = d.get("steps") or []
    if not steps:
        return _failed(state, specs)
    ended = _ended(state)
    forced = d.get("cpu_fp16", "")
    skipped = [s["step"] for s in steps if s["skipped"]]
    applied = [s for s in steps if not s["skipped"]]
    scales = [s["scale"] for s in steps]
    first_applied = applied[0]["step"] if applied else None
    ok_skips = bool(skipped) and skipped[0] == 1
    ok_scale = bool(applied) and min(scales) < 2.0 ** power and first_applied is not None
    losses = [s["loss"] for s in applied]
    ok_applied = bool(applied) and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    partial = f"; only {len(steps)} of {d.get('iters_planned')} steps" if len(steps) < d.get("iters_planned", 0) else ""
    return [
        Row(specs[0][0], specs[0][1], f"{len(skipped)} of {len(steps)}", specs[0][2],
            ended or ("pass" if ok_skips else "FAIL"),
            f"skipped steps {skipped}; module weights {d.get('weights')}; hysteresis 2, loss_scale_window "
            f"{d.get('window')}{partial}"
            + (f"; {forced}" if forced else "")),
        Row(specs[1][0], specs[1][1], _trajectory(scales) + f" (final {_fmt_pow2(d.get('final_scale', 0))})",
            specs[1][2], ended or ("pass" if ok_scale else "FAIL"),
            f"first applied step {first_applied}; the scale doubles after {d.get('window')} clean steps"),
        Row(specs[2][0], specs[2][1],
            f"{len(applied)} applied" + (f"; {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""),
            specs[2][2], ended or ("pass" if ok_applied else "FAIL"), "losses of the applied steps")]


def rows_c(state: dict, a, unit: str) -> list[Row]:
    d = state.get("data", {})
    recompute = unit == "c-recompute"
    label = "with recomputation" if recompute else "no recomputation"
    bar = f">= {a.mfu_bar:.0%} ({MFU_REFERENCE})"
    specs = [(f"{unit}.tokens_per_s", f"(c) train tokens/s, {label}", "-"),
             (f"{unit}.mfu", f"(c) MFU, {label}", bar)]
    if "tokens_per_s" not in d:
        rows = _failed(state, specs)
        if d.get("iteration_seconds") is not None or state.get("attempts"):
            for r in rows:
                r.note += f"; micro-batch {d.get('micro_batch_size')}, attempts {state.get('attempts')}"
        return rows
    ended = _ended(state)
    retried = f"; retried after OOM at micro-batch {state['attempts'][0]['micro_batch_size']}" \
        if state.get("attempts") else ""
    timed = len(d.get("iteration_seconds", []))
    memory = (f"; peak memory {d['peak_memory_gb']:.1f} of {d['total_memory_gb']:.0f} GB"
              if "peak_memory_gb" in d else "")
    note_tps = (f"{d.get('parameters', 0) / 1e9:.3f} B parameters, {d.get('weights')}; micro-batch "
                f"{d['micro_batch_size']} x "
                f"{d['num_microbatches']} micro-batches = {d['global_batch']} x {d['seq_length']} tokens per step; "
                f"{timed} timed after {d['warmup']} warm-up, mean {d['seconds_per_iteration']:.3f} s, median "
                f"{d['median_seconds']:.3f} s per step{memory}{retried}; {d.get('shape', '')}")
    on_gpu = a.device == "cuda"
    mfu = d["mfu"]
    status = ended or (("pass" if mfu >= a.mfu_bar else "below bar") if on_gpu else "info")
    note_mfu = f"{d['model_tflops']:.1f} TFLOP/s of {a.peak_tflops:g} peak (bf16 dense)"
    if recompute:
        note_mfu += (f"; counting the recomputed forward too (flops.py with checkpoint_activations, as pretrain.py "
                     f"logs it): {d['mfu_with_recompute_flops']:.1%}")
    if not on_gpu:
        note_mfu += "; CPU smoke run: MFU against a GPU peak means nothing here"
    if not d.get("losses_finite", True):
        status, note_mfu = "FAIL", note_mfu + "; a loss was NaN/Inf"
    return [Row(specs[0][0], specs[0][1], f"{d['tokens_per_s']:,.0f}", "-", ended or "info", note_tps),
            Row(specs[1][0], specs[1][1], f"{mfu:.1%}", bar, status, note_mfu)]


def rows_d(state: dict, a) -> list[Row]:
    d = state.get("data", {})
    specs = [("d.ours", "(d) generation tokens/s, ours (KV cache)", "-"),
             ("d.hf", "(d) generation tokens/s, HF generate", "-"),
             ("d.ratio", "(d) ours / HF generate", ">= 1.0"),
             ("d.greedy", "(d) greedy tokens, ours vs HF", "equal in fp32; reported in bf16/fp16")]
    if "ours_tokens_per_s" not in d and "hf_tokens_per_s" not in d:
        return _failed(state, specs)
    ended = _ended(state)
    what = (f"batch {d.get('batch')}, {d.get('new_tokens')} new tokens, prompts {min(d.get('prompt_lengths', [0]))}-"
            f"{max(d.get('prompt_lengths', [0]))} tokens left-padded, greedy, {d.get('dtype')}; median of "
            f"{len(d.get('seconds', {}).get('ours', []))} runs")
    rows = []
    for key, check, bar in specs[:2]:
        field = "ours_tokens_per_s" if key == "d.ours" else "hf_tokens_per_s"
        if field in d:
            extra = f"; HF attention {d.get('hf_attention')}" if key == "d.hf" else f"; {d.get('shape', '')}"
            rows.append(Row(key, check, f"{d[field]:,.1f}", bar, ended or "info", what + extra))
        else:
            rows.extend(_failed(state, [(key, check, bar)]))
    if "ours_tokens_per_s" in d and "hf_tokens_per_s" in d:
        ratio = d["ours_tokens_per_s"] / d["hf_tokens_per_s"]
        rows.append(Row("d.ratio", specs[2][1], f"{ratio:.2f}x", specs[2][2],
                        ended or ("pass" if ratio >= 1.0 else "below bar"),
                        "same weights, prompts and device, runs interleaved"))
    else:
        rows.extend(_failed(state, [specs[2]]))
    if "rows_identical" in d:
        exact = d["dtype"] == "fp32"
        same = d["rows_identical"] == d["batch"] and d.get("lengths_ok", True)
        status = ended or (("pass" if same else "FAIL") if exact else "info")
        rows.append(Row("d.greedy", specs[3][1], f"{d['rows_identical']} of {d['batch']} rows identical", specs[3][2],
                        status, f"common prefix per row {d['common_prefix']} of {d['new_tokens']}"
                        + ("" if exact else f"; {d['dtype']}: different kernels may flip near-ties")))
    else:
        rows.extend(_failed(state, [specs[3]]))
    return rows


def unit_rows(unit: str, state: dict, a) -> list[Row]:
    try:
        if unit == "a":
            return rows_a(state, a)
        if unit == "b":
            return rows_b(state, a)
        if unit in ("c", "c-recompute"):
            return rows_c(state, a, unit)
        return rows_d(state, a)
    except Exception as e:  # noqa: BLE001 - a bug in a row builder is a row, not a lost table
        return [Row(f"{unit}.report", f"({unit[0]}) report", "-", "-", "error", f"building the rows: {e!r}")]


def render_text(rows: list[Row], header: list[str]) -> str:
    names = ("check", "measured", "bar / expected", "status")
    cells = [(r.check, r.measured, r.bar, r.status) for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = header + [""]
    lines.append("  ".join(f"{n:{w}}" for n, w in zip(names, widths)) + "  note")
    lines.append("  ".join("-" * w for w in widths) + "  ----")
    for r, c in zip(rows, cells):
        lines.append("  ".join(f"{x:{w}}" for x, w in zip(c, widths)) + "  " + r.note)
    return "\n".join(lines)


def render_markdown(rows: list[Row], header: list[str]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["# GPU check", ""] + [f"- {h}" for h in header] + [""]
    lines.append("| check | measured | bar / expected | status | note |")
    lines.append("|---|---|---|---|---|")
    for r in rows:
        lines.append(f"| {esc(r.check)} | {esc(r.measured)} | {esc(r.bar)} | {esc(r.status)} | {esc(r.note)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    if a.child:
        return child_main(a)
    wall_start = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)  # take the running unit's process (own session) down with us
    out_dir = Path(a.output_dir or os.environ.get("OUT") or ROOT / "outputs" / "gpu_check").resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    if a.device == "cuda":
        import torch  # the CPU path leaves torch to the children: the parent stays light

        if not torch.cuda.is_available():
            print("error: --device cuda but no GPU is visible to torch (use --device cpu --smoke on a CPU machine)",
                  file=sys.stderr)
            return 2
    budgets = dict(SMOKE_BUDGETS_S if a.smoke else DEFAULT_BUDGETS_S)
    budgets.update(dict(a.budget))
    units = [u for u in UNITS if u[0] in a.sections]
    print(f"gpu check: units {', '.join(units)} on {a.device}{' (smoke)' if a.smoke else ''}; budgets "
          + ", ".join(f"{u} {budgets[u]:.0f} s" for u in units) + f"; output {out_dir}", flush=True)
    states: dict[str, dict] = {}
    rows: list[Row] = []
    interrupted = None
    for unit in units:
        if interrupted is not None:  # still one row per check: the table keeps its shape
            states[unit] = {"data": {}, "skipped_by_parent": f"not run: {interrupted}"}
            rows += unit_rows(unit, states[unit], a)
            continue
        try:
            state = run_unit(unit, argv, a, budgets[unit], out_dir)
        except Interrupted as e:  # SIGTERM/SIGINT (an outer timeout): the unit's process is down; report what ran
            interrupted = e
            state = getattr(e, "state", None) or {"data": {}, "error": f"{e} while running", "seconds": 0.0}
        states[unit] = state
        how = "timeout" if state.get("timeout") else "error" if state.get("error") else "ok"
        print(f"[{unit}] {how} in {state['seconds']:.1f} s (start-up {state.get('startup_seconds', 0):.1f} s)"
              + (f": {state['error']}" if state.get("error") else "")
              + (f" (log {out_dir / state['log']})" if state.get("log") else ""), flush=True)
        rows += unit_rows(unit, state, a)
    present = {r.key for r in rows}
    for key in ROW_KEYS:  # every check of the units run has its row, whatever happened (else a bug here)
        if key.split(".")[0] in units and key not in present:
            rows.append(Row(key, key, "-", "-", "error", "row missing from the report (a bug in benchmarks/gpu.py)"))
    seen = next((s for s in states.values() if s.get("device")), {})
    header = [(f"device: {seen.get('device', a.device)} (backend {seen.get('backend', '?')}); torch "
               f"{seen.get('torch', '?')}, deepspeed {seen.get('deepspeed', '?')}; peak {a.peak_tflops:g} TFLOP/s "
               f"bf16 dense; MFU bar {a.mfu_bar:.0%} ({MFU_REFERENCE})"),
              (f"{'smoke (tiny shapes) ' if a.smoke else ''}run of {time.strftime('%Y-%m-%d %H:%M:%S')}, "
               f"{time.monotonic() - wall_start:.0f} s wall; units in separate processes, each a torch.distributed "
               f"world of one under ZeRO-2")]
    text = render_text(rows, header)
    (out_dir / "gpu_check.md").write_text(render_markdown(rows, header))
    (out_dir / "gpu_check.json").write_text(json.dumps(
        {"header": header, "argv": argv, "rows": [asdict(r) for r in rows], "units": states,
         "wall_seconds": time.monotonic() - wall_start}, indent=1, default=str))
    print("\n" + text, flush=True)
    print(f"\nwritten: {out_dir / 'gpu_check.json'}, {out_dir / 'gpu_check.md'}", flush=True)
    if interrupted is not None:
        return 128 + interrupted.signum
    return 1 if any(r.status in BAD for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
