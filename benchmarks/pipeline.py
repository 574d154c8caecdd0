"""Pipeline parallelism on CPU: the 1F1B bubble against theory, and PP=2 against PP=1 in the real training loop.

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions WANDB_MODE=offline \
        .venv/bin/python benchmarks/pipeline.py          # ~2-3 min on a 2-core machine

1. Bubble. The real executor (one_f_one_b -> with_p2p_ops -> run_schedule, P2PCommunicator) runs on p real
   gloo ranks with a synthetic stage whose forward sleeps F ms and backward 2F ms. Sleeping ranks don't compete
   for cores, so 4 stages on 2 cores time like 4 devices and the numbers are deterministic up to OS jitter.
   Per stage: bubble = 1 - (time spent in forward/backward) / (step wall time), the wall time being the slowest
   rank's from a common barrier; printed as the mean over stages (and the first stage's). One warm-up step,
   then the mean of --steps timed steps. Theory: (p - 1) / (m + p - 1); the excess is p2p latency.
2. Training. codegeex_train.pretrain.main on 2 gloo ranks, once with PP=2 (DP=1, 8 micro-batches of 4 per step)
   and once with PP=1 (DP=2, 4 per rank), same model and global batch 32; tokens/s is read from
   <save>/metrics.jsonl and averaged over iterations after the first two. On CPU, PP=1/DP=2 has no bubble and
   each rank holds the whole model, so PP2/PP1 < 1 measures the bubble + p2p (+ stage imbalance: the last stage
   also holds the logits) cost, less the gradient all-reduce DP=2 pays and PP=2 does not; not the speed-up
   pipelining buys when a model does not fit on one GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

BUBBLE_CONFIGS = {2: (2, 4, 8), 4: (4, 8)}  # pp size -> micro-batch counts, one spawn per pp size


class SleepStage:
    """Forward F ms, backward 2F ms; outputs carry no autograd, only the shape the next stage expects."""

    def __init__(self, fwd_s: float, shape: tuple[int, ...], is_first: bool):
        self.fwd_s, self.shape, self.is_first = fwd_s, shape, is_first
        self.compute_s = 0.0

    def _work(self, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.compute_s += time.perf_counter() - t0  # the real slept time, overshoot included

    def forward_step(self, mb, input_tensor):
        self._work(self.fwd_s)
        return torch.zeros(self.shape)

    def backward_step(self, mb, input_tensor, output, output_grad):
        self._work(2 * self.fwd_s)
        return None if self.is_first else torch.zeros(self.shape)


def bubble_rank(topology, micro_batches, fwd_ms, steps):
    """Per micro-batch count: this stage's mean bubble and the mean step wall time over the timed steps."""
    from codegeex_train.pipeline import P2PCommunicator, one_f_one_b, run_schedule, with_p2p_ops

    shape = (1, 16, 32)
    out = {}
    for m in micro_batches:
        ops = with_p2p_ops(one_f_one_b(topology.pp_size, topology.pp_rank, m), topology.is_first_stage,
                           topology.is_last_stage)
        bubbles, walls = [], []
        for step in range(steps + 1):  # step 0 warms up gloo's pairs
            stage = SleepStage(fwd_ms / 1e3, shape, topology.is_first_stage)
            comm = P2PCommunicator.for_topology(topology, shape=shape, dtype=torch.float32,
                                                device=torch.device("cpu"))
            dist.barrier()  # a common start
            t0 = time.perf_counter()
            run_schedule(ops, stage, comm)
            wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when its slowest stage does
            if step:
                bubbles.append(1 - stage.compute_s / wall.item())
                walls.append(wall.item())
        out[m] = (sum(bubbles) / steps, sum(walls) / steps)
    return out


def run(topology, argv, log):
    from codegeex_train import pretrain

    # Ranks' own logging (per-iteration lines, DeepSpeed) goes to a file so the benchmark prints only its table;
    # a failure still reaches the parent as a traceback through the harness.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    pretrain.main(argv)


def train_args(data, save, pp, iters):
    return ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "32",
            "--pipeline-model-parallel-size", str(pp), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--lr", "2e-3", "--lr-warmup-iters", "2", "--train-iters", str(iters), "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--data-path", data, "--split", "90,9,1",
            "--seed", "7", "--save", save, "--no-progress-bar", "--num-workers", "0"]


def tokens_per_s(save, skip):
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    vals = [r["tokens_per_s"] for r in rows if r.get("split", "train") == "train" and r["iteration"] > skip]
    return sum(vals) / len(vals)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fwd-ms", type=float, default=10.0, help="synthetic forward time; backward is twice it")
    p.add_argument("--steps", type=int, default=3, help="timed steps per (p, m) after one warm-up step")
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--skip-iters", type=int, default=2, help="first iterations left out of the tokens/s mean")
    a = p.parse_args(argv)
    # Before DeepSpeed is imported anywhere (spawned ranks inherit these): CPU accelerator, this checkout's
    # JIT op cache, one thread per rank.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(root, ".cache", "torch_extensions"))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ["OMP_NUM_THREADS"] = "1"
    from codegeex_train.testing import run_distributed

    print(f"1F1B bubble: synthetic stage, forward {a.fwd_ms:g} ms / backward {2 * a.fwd_ms:g} ms (sleep), "
          f"gloo p2p, 1 warm-up + {a.steps} timed steps")
    print(f"  {'p':>2} {'m':>3} {'bubble (mean stages)':>20} {'first stage':>11} {'theory':>7} "
          f"{'step ms':>8} {'ideal ms':>8}")
    for pp, ms in BUBBLE_CONFIGS.items():
        per_rank = run_distributed(bubble_rank, world_size=pp, tp_size=1, pp_size=pp, deadline_s=120.0,
                                   micro_batches=ms, fwd_ms=a.fwd_ms, steps=a.steps)
        for m in ms:
            mean = sum(r[m][0] for r in per_rank) / pp
            ideal = (m + pp - 1) * 3 * a.fwd_ms  # every F+B slot of the 1F1B timeline, no p2p cost
            print(f"  {pp:>2} {m:>3} {mean:20.3f} {per_rank[0][m][0]:11.3f} {(pp - 1) / (m + pp - 1):7.3f} "
                  f"{1e3 * per_rank[0][m][1]:8.0f} {ideal:8.0f}", flush=True)

    # The DeepSpeed CPU comm op is JIT-built on first use; build (or load) it here, outside the ranks' timeouts.
    from deepspeed.accelerator import get_accelerator

    from codegeex_train.data.default_corpus import default_corpus_files
    from codegeex_train.data.preprocess import TokenizerSpec, preprocess

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and builder.is_compatible():
        builder.load()
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            summary = preprocess(default_corpus_files()[:60], os.path.join(tmp, "stdlib"),
                                 TokenizerSpec(whitespace_encoding=True), append_eod=True, workers=1, progress=False)
        data = summary.output_prefixes[0]
        print(f"\ntraining loop: pretrain.main on 2 gloo ranks x 1 thread; 4 layers, hidden 256, 8 heads, seq 128, "
              f"micro batch 4, global batch 32; {a.train_iters} iterations, tokens/s averaged over iterations > "
              f"{a.skip_iters}")
        results = {}
        for pp in (1, 2):
            save = os.path.join(tmp, f"pp{pp}")
            t0 = time.perf_counter()
            run_distributed(run, world_size=2, tp_size=1, pp_size=pp, deadline_s=240.0, collective_timeout_s=120.0,
                            argv=train_args(data, save, pp, a.train_iters), log=os.path.join(tmp, f"pp{pp}.log"))
            results[pp] = tokens_per_s(save, a.skip_iters)
            print(f"  PP={pp} DP={2 // pp}: {results[pp]:8.0f} tokens/s  ({32 // 4 // (2 // pp)} micro-batches "
                  f"per rank per step; run {time.perf_counter() - t0:.0f} s)", flush=True)
        print(f"  PP2/PP1 = {results[2] / results[1]:.2f}  (on CPU, PP=1 with DP=2 has no bubble: this ratio is the "
              f"bubble + p2p + stage-imbalance cost, less DP's gradient all-reduce; not a GPU speed-up)")


if __name__ == "__main__":
    main()
