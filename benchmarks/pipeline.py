"""Pipeline parallelism on CPU: the (interleaved) 1F1B bubble against theory, PP=2 against PP=1 and interleaved
(v = 2) against plain 1F1B (v = 1) in the real training loop.

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions WANDB_MODE=offline \
        .venv/bin/python benchmarks/pipeline.py          # ~10 min on a 2-core machine
    .venv/bin/python benchmarks/pipeline.py --only bubble --quick  # the bubble table at p = 2, seconds

1. Bubble. The real executor (interleaved_one_f_one_b -> with_p2p_ops(..., num_chunks=v) -> run_schedule over
   P2PCommunicator, the ring for v > 1) runs on p real gloo ranks with a synthetic chunked stage whose forward of one
   chunk sleeps F/v ms and its backward 2F/v (v = 1 is plain 1F1B, the same ops the trainer runs). Sleeping ranks
   don't compete for cores, so 4 stages on 2 cores time like 4 devices and the numbers are deterministic up to OS
   jitter; F = 40 ms by default, large against gloo's latency per exchange (a few ms when other jobs load the cores:
   v = 2 makes twice the exchanges around half the compute). Per stage: idle = step wall time - time in
   forward/backward, the wall time being the slowest rank's from a common barrier. Printed: idle / compute summed
   over the stages (Megatron's bubble time fraction, theory (p - 1) / (v m)) and idle / wall ((p - 1) / (v m + p -
   1)); the dependency replay with free transfers (pipeline/simulate.py) gives exactly the theory, so the excess is
   p2p latency. One warm-up step, then the mean of --steps timed steps.
2. PP=2 against PP=1: codegeex_train.pretrain.main on 2 gloo ranks, once with PP=2 (DP=1, 8 micro-batches of 4 per
   step) and once with PP=1 (DP=2, 4 per rank), same model and global batch 32; tokens/s is read from
   <save>/metrics.jsonl and averaged over iterations after the first two. On CPU, PP=1/DP=2 has no bubble and
   each rank holds the whole model, so PP2/PP1 < 1 measures the bubble + p2p (+ stage imbalance: the last stage
   also holds the logits) cost, less the gradient all-reduce DP=2 pays and PP=2 does not; not the speed-up
   pipelining buys when a model does not fit on one GPU.
3. Interleaved against plain 1F1B: pretrain.main at PP=2 on the same 2 ranks, with and without
   --num-layers-per-virtual-pipeline-stage 1 (4 layers: v = 2 chunks of one layer per stage), alternated
   (v1, v2, v1, v2, ...) inside one spawn so that the machine's drift hits both alike. What makes the bubble, not the
   2 cores, decide: each rank runs on its own core (OMP_NUM_THREADS=1: one core per stage, as one device per stage);
   m = p = 2 micro-batches per step, where 1F1B idles (p - 1)/(m + p - 1) = 1/3 of a step and interleaving 1/5
   (balanced stages: (m + p - 1)/(m + (p - 1)/v) = 1.2 faster); a wide model (h 1024, 16 heads, seq 128, micro-batch
   8: ~0.7 s of GEMMs per layer and micro-batch) whose per-layer compute dwarfs a 4 MB gloo transfer (~ms), without
   the top query layer and with the 8192-token output layer (2/3 of a layer): the last stage is 4/3 of the first,
   which the dependency replay puts at 1.16 for v = 2 over v = 1. Also printed: each rank's CPU seconds per step
   (the median), which shows what v = 2 costs beyond the schedule: DeepSpeed's ZeRO-2 makes a pass over the whole
   gradient partition at the end of every backward, and a rank runs m v of them instead of m (why 1024 tokens per
   micro-batch: the pass is per parameter, the compute per parameter and token). The optimizer step, the same for
   both, dilutes the ratio too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from statistics import median

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this checkout's codegeex_train, whatever else is installed
    sys.path.insert(0, ROOT)

from codegeex_train.layout.dims import ParallelDims  # noqa: E402  (pure values: imports neither torch nor DeepSpeed)

BUBBLE_CONFIGS = {2: (2, 4, 8), 4: (4, 8)}  # pp size -> micro-batch counts, one spawn per pp size
QUICK_BUBBLE_CONFIGS = {2: (2, 4)}
CHUNKS = (1, 2)  # v: plain 1F1B, interleaved
SECTIONS = ("bubble", "pp", "interleaved")


class SleepStage:
    """A ``ChunkedPipelineStage``: a chunk's forward sleeps F/v, its backward 2F/v; outputs carry no autograd, only
    the shape the next stage expects."""

    def __init__(self, fwd_s: float, shape: tuple[int, ...], is_first: bool, num_chunks: int = 1):
        self.fwd_s, self.shape, self.is_first = fwd_s / num_chunks, shape, is_first
        self.compute_s = 0.0

    def _work(self, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.compute_s += time.perf_counter() - t0  # the real slept time, overshoot included

    def forward_step(self, mb, chunk, input_tensor):
        self._work(self.fwd_s)
        return torch.zeros(self.shape)

    def backward_step(self, mb, chunk, input_tensor, output, output_grad):
        self._work(2 * self.fwd_s)
        return None if self.is_first and chunk == 0 else torch.zeros(self.shape)  # the first virtual stage: ids


def bubble_rank(topology, micro_batches, fwd_ms, steps, chunks=CHUNKS):
    """Per (v, micro-batch count): this stage's mean idle and compute seconds and the mean step wall time."""
    from codegeex_train.pipeline import P2PCommunicator, interleaved_one_f_one_b, run_schedule, with_p2p_ops

    shape = (1, 16, 32)
    out = {}
    for v in chunks:
        for m in micro_batches:
            ops = with_p2p_ops(interleaved_one_f_one_b(topology.pp_size, topology.pp_rank, m, v),
                               topology.is_first_stage, topology.is_last_stage, v)
            idle, compute, walls = [], [], []
            for step in range(steps + 1):  # step 0 warms up gloo's pairs
                stage = SleepStage(fwd_ms / 1e3, shape, topology.is_first_stage, v)
                comm = P2PCommunicator.for_topology(topology, shape=shape, dtype=torch.float32,
                                                    device=torch.device("cpu"), num_chunks=v)
                dist.barrier()  # a common start
                t0 = time.perf_counter()
                run_schedule(ops, stage, comm, chunked=True)
                wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when its slowest stage does
                if step:
                    idle.append(wall.item() - stage.compute_s)
                    compute.append(stage.compute_s)
                    walls.append(wall.item())
            out[v, m] = (sum(idle) / steps, sum(compute) / steps, sum(walls) / steps)
    return out


def bubble_rows(per_rank, pp, micro_batches, chunks=CHUNKS):
    """(p, v, m, measured idle/compute, theory (p-1)/(v m), measured idle/wall, theory (p-1)/(v m + p-1), step s)
    from ``bubble_rank``'s results on every rank, summed over the stages."""
    rows = []
    for v in chunks:
        for m in micro_batches:
            idle = sum(r[v, m][0] for r in per_rank)
            compute = sum(r[v, m][1] for r in per_rank)
            wall = per_rank[0][v, m][2]
            rows.append((pp, v, m, idle / compute, (pp - 1) / (v * m), idle / (pp * wall), (pp - 1) / (v * m + pp - 1),
                         wall))
    return rows


def bubble_section(run_distributed, configs, fwd_ms, steps):
    print(f"1F1B bubble, plain (v = 1) and interleaved (v = 2): synthetic stage, a chunk's forward {fwd_ms:g}/v ms, "
          f"backward {2 * fwd_ms:g}/v ms (sleep), gloo p2p, 1 warm-up + {steps} timed steps")
    print(f"  {'p':>2} {'v':>2} {'m':>3} {'idle/compute':>12} {'(p-1)/(vm)':>10} {'idle/step':>9} "
          f"{'(p-1)/(vm+p-1)':>14} {'step ms':>8} {'ideal ms':>8}")
    for pp, ms in configs.items():
        per_rank = run_distributed(bubble_rank, ParallelDims(pp, 1, pp), deadline_s=180.0,
                                   micro_batches=ms, fwd_ms=fwd_ms, steps=steps)
        for p, v, m, ratio, theory, fraction, fraction_theory, wall in bubble_rows(per_rank, pp, ms):
            ideal = (m + (p - 1) / v) * 3 * fwd_ms  # every slot of the timeline, no p2p cost
            print(f"  {p:>2} {v:>2} {m:>3} {ratio:12.3f} {theory:10.3f} {fraction:9.3f} {fraction_theory:14.3f} "
                  f"{1e3 * wall:8.0f} {ideal:8.0f}", flush=True)


def run(topology, argvs, log):
    """``pretrain.main`` for each argv in turn, on these ranks; returns each run's (wall, CPU) seconds per step."""
    from codegeex_train import pretrain
    from codegeex_train.training import trainer

    # Ranks' own logging (per-iteration lines, DeepSpeed) goes to a file so the benchmark prints only its table;
    # a failure still reaches the parent as a traceback through the harness.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    step, times = trainer.train_step, []

    def timed(*args, **kwargs):  # the training step alone (CPU: no queued kernels to wait for)
        wall, cpu = time.perf_counter(), time.process_time()
        loss = step(*args, **kwargs)
        times[-1].append((time.perf_counter() - wall, time.process_time() - cpu))
        return loss

    trainer.train_step = timed
    for argv in argvs:
        times.append([])
        pretrain.main(argv)
    return times


def train_args(data, save, pp, iters):
    return ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "32",
            "--pipeline-model-parallel-size", str(pp), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--lr", "2e-3", "--lr-warmup-iters", "2", "--train-iters", str(iters), "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--data-path", data, "--split", "90,9,1",
            "--seed", "7", "--save", save, "--no-progress-bar", "--num-workers", "0"]


# Section 3's shape (module docstring): wide layers, m = p = 2, each chunk one layer, no top query layer.
INTERLEAVED_SHAPE = {"--num-layers": "4", "--hidden-size": "1024", "--num-attention-heads": "16",
                     "--seq-length": "128", "--max-position-embeddings": "128", "--micro-batch-size": "8",
                     "--global-batch-size": "16", "--lr": "2e-4"}  # the wide model diverges at 2e-3
QUICK_INTERLEAVED_SHAPE = {**INTERLEAVED_SHAPE, "--hidden-size": "128", "--num-attention-heads": "4",
                           "--seq-length": "64", "--max-position-embeddings": "64", "--micro-batch-size": "4",
                           "--global-batch-size": "8"}


def interleaved_args(data, save, shape, num_chunks, iters):
    base = train_args(data, save, 2, iters)
    for flag, value in shape.items():
        base[base.index(flag) + 1] = value
    chunks = str(int(shape["--num-layers"]) // (2 * num_chunks))
    return base + ["--no-top-query-layer"] + (["--num-layers-per-virtual-pipeline-stage", chunks]
                                              if num_chunks > 1 else [])


def tokens_per_s(save, skip):
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    vals = [r["tokens_per_s"] for r in rows if r.get("split", "train") == "train" and r["iteration"] > skip]
    return sum(vals) / len(vals)


def pp_section(run_distributed, data, tmp, iters, skip):
    print(f"\ntraining loop: pretrain.main on 2 gloo ranks x 1 thread; 4 layers, hidden 256, 8 heads, seq 128, "
          f"micro batch 4, global batch 32; {iters} iterations, tokens/s averaged over iterations > {skip}")
    results = {}
    for pp in (1, 2):
        save = os.path.join(tmp, f"pp{pp}")
        t0 = time.perf_counter()
        run_distributed(run, ParallelDims(2, 1, pp), deadline_s=240.0, collective_timeout_s=120.0,
                        argvs=[train_args(data, save, pp, iters)], log=os.path.join(tmp, f"pp{pp}.log"))
        results[pp] = tokens_per_s(save, skip)
        print(f"  PP={pp} DP={2 // pp}: {results[pp]:8.0f} tokens/s  ({32 // 4 // (2 // pp)} micro-batches "
              f"per rank per step; run {time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"  PP2/PP1 = {results[2] / results[1]:.2f}  (on CPU, PP=1 with DP=2 has no bubble: this ratio is the "
          f"bubble + p2p + stage-imbalance cost, less DP's gradient all-reduce; not a GPU speed-up)")


def interleaved_section(run_distributed, data, tmp, iters, skip, rounds, shape):
    words = ", ".join(f"{k.lstrip('-').replace('-', ' ')} {v}" for k, v in shape.items())
    print(f"\ninterleaved 1F1B against plain: pretrain.main at PP 2 (DP 1) on 2 gloo ranks x 1 thread; {words}, "
          f"no top query layer (m = 2); v = 1 and v = 2 (one layer per chunk) alternated, {rounds} round(s) of "
          f"{iters} iterations each, tokens/s averaged over iterations > {skip}")
    saves = [(v, os.path.join(tmp, f"interleaved-{k}-v{v}")) for k in range(rounds) for v in CHUNKS]
    t0 = time.perf_counter()
    times = run_distributed(run, ParallelDims(2, 1, 2), deadline_s=600.0 * rounds,
                            collective_timeout_s=300.0, log=os.path.join(tmp, "interleaved.log"),
                            argvs=[interleaved_args(data, save, shape, v, iters) for v, save in saves])
    results = {v: [tokens_per_s(save, skip) for w, save in saves if w == v] for v in CHUNKS}
    for v in CHUNKS:
        steps = [[t for (w, _), run_times in zip(saves, rank) if w == v for t in run_times[skip:]] for rank in times]
        cpu = ", ".join(f"rank {r} {median([c for _, c in s]):.2f} s" for r, s in enumerate(steps))
        print(f"  v={v}: {sum(results[v]) / rounds:8.0f} tokens/s  (rounds: "
              f"{', '.join(f'{x:.0f}' for x in results[v])}); per step {median([w for w, _ in steps[0]]):.2f} s, "
              f"CPU {cpu}")
    pairs = [b / a for a, b in zip(results[1], results[2])]
    print(f"  v2/v1 = {sum(results[2]) / sum(results[1]):.2f}  (per round: {', '.join(f'{r:.2f}' for r in pairs)}; "
          f"the schedule replayed at the default shape: 1.16; all runs {time.perf_counter() - t0:.0f} s)", flush=True)


def prepare_data(tmp):
    """The stdlib corpus, preprocessed; DeepSpeed's CPU comm op built (or loaded) outside the ranks' timeouts."""
    from deepspeed.accelerator import get_accelerator

    from codegeex_train.preprocessing.default_corpus import default_corpus_files
    from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and builder.is_compatible():
        builder.load()
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        summary = preprocess(default_corpus_files()[:60], os.path.join(tmp, "stdlib"),
                             TokenizerSpec(whitespace_encoding=True), append_eod=True, workers=1, progress=False)
    return summary.output_prefixes[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=SECTIONS, action="append", help="run only this section (repeatable)")
    p.add_argument("--quick", action="store_true", help="seconds, not minutes: the bubble at p = 2 only, a narrow "
                   "model for the interleaved run, few iterations (a smoke test, not figures)")
    p.add_argument("--fwd-ms", type=float, default=40.0, help="synthetic forward time of a stage (a chunk: 1/v of "
                   "it); backward is twice it")
    p.add_argument("--steps", type=int, default=3, help="timed steps per (p, v, m) after one warm-up step")
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--interleaved-iters", type=int, default=6, help="iterations of each interleaved-section run")
    p.add_argument("--rounds", type=int, default=3, help="v = 1, v = 2 pairs in the interleaved section")
    p.add_argument("--skip-iters", type=int, default=2, help="first iterations left out of the tokens/s mean")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    sections = a.only or list(SECTIONS)
    if a.quick:
        a.steps, a.train_iters, a.interleaved_iters, a.rounds, a.skip_iters = 1, 3, 3, 1, 1
    # Before DeepSpeed is imported anywhere (spawned ranks inherit these): CPU accelerator, this checkout's
    # JIT op cache, one thread per rank.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(root, ".cache", "torch_extensions"))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ["OMP_NUM_THREADS"] = "1"
    from codegeex_train.distributed.spawn import run_distributed

    if "bubble" in sections:
        bubble_section(run_distributed, QUICK_BUBBLE_CONFIGS if a.quick else BUBBLE_CONFIGS, a.fwd_ms, a.steps)
    if "pp" not in sections and "interleaved" not in sections:
        return
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        data = prepare_data(tmp)
        if "pp" in sections:
            pp_section(run_distributed, data, tmp, a.train_iters, a.skip_iters)
        if "interleaved" in sections:
            interleaved_section(run_distributed, data, tmp, a.interleaved_iters, a.skip_iters, a.rounds,
                                QUICK_INTERLEAVED_SHAPE if a.quick else INTERLEAVED_SHAPE)


if __name__ == "__main__":
    main()
