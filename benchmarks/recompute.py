"""Activation recomputation and sequence parallelism at TP 2: step time and memory per rank, in one run.

On the same two gloo ranks (TP 2, DP 1, ZeRO-2, fp32), eight engines of the same model are built side by side:

  recompute  none | selective (core_attn) | selective (core_attn mlp_act layernorm) | full (uniform, 1 layer)
  SP         off  | on (--sequence-parallel)

and trained on the same batches, iterations interleaved (variant order reversed every other iteration, so drift on a
shared machine hits all alike). Before each variant's iteration the default RNG stream is reseeded and every
variant has its own TP-rank stream advancing in step, so the recompute variants of one SP setting draw the same
dropout masks and their losses must agree (printed: the largest difference to "none").

Per variant:
  step ms       median over the timed iterations of the slowest rank's forward + backward + optimizer step;
  tokens/s      global tokens per step (micro-batch x seq; DP 1) / step time;
  overhead      step time / the step time of "none" with the same SP setting, minus 1;
  CPU ms, ovh   the same from the ranks' CPU time (all threads) instead of the wall clock: steadier on a machine
                shared with other work, where a rank waits for a core (the run's header line says how much);
  saved MB      what autograd keeps from forward to backward for one micro-batch on one rank: the distinct
                storages saved-tensor hooks see (accounting.memory.SavedActivations), parameters excluded. The
                transient rebuild of one recomputed part in backward is not in it;
  peak MB       the most CPU tensor memory live at once during forward + backward, above what was live at the
                step's start (the profiler's allocation records, in time order): the kept activations, their
                transient rebuild, the gradients and ZeRO-2's reduce bucket (sized to the rank's parameters here);
  RSS +MB       the rank's peak resident memory during forward + backward (VmHWM, reset through
                /proc/self/clear_refs just before) minus its resident memory at the step's start, what the OS sees.
                Tensors under glibc's mmap threshold (fixed at 4 MiB here, as in training) may reuse heap the
                process already holds (freed by the other variants), so it is a noisy lower bound.
Memory columns are the larger of the two ranks (they are symmetric); each is measured in one untimed iteration.
The paper's per-layer ratios for the same a, s, h and t are printed under the table for comparison (theirs: fp16,
one layer, no embeddings, loss or top query layer).

The default shape makes the s x s attention matter: 4 layers + the top query layer, hidden 256, 8 heads, seq 512
(5as/h = 80, CodeGeeX-13B's own value: 5 x 40 x 2048 / 5120), micro-batch 4, vocab 1024, fast GeLU, dropout 0.1 on
the hidden states and the attention probabilities. Attention dropout on is what makes CPU SDPA take its math path,
which keeps the s x s probabilities and dropout mask (without dropout, CPU SDPA is a fused kernel that keeps no
s x s tensor, as on GPUs: selective core_attn then saves only the log-sum-exp, the attention output being the next
linear's saved input anyway).

    python benchmarks/recompute.py        # 105 s of CPU per rank: ~2 min on 2 idle cores, 4.5 min measured on busy ones
    python benchmarks/recompute.py --num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 128 \\
        --micro-batch-size 2 --warmup-iters 0 --iters 1 --json out.json     # ~15 s (tests/benchmarks/)

Ranks are spawned here (codegeex_train.distributed.spawn.run_distributed), one thread each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from codegeex_train.config.arguments import Args, DataConfig, LoggingConfig, OptimConfig, ParallelConfig, TrainConfig
from codegeex_train.config.deepspeed import build_deepspeed_config
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.recompute import MODULES, Recompute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this checkout's codegeex_train, whatever else is installed
    sys.path.insert(0, ROOT)

TP = 2
RECOMPUTES = (("none", Recompute()),
              ("selective core_attn", Recompute("selective", modules=("core_attn",))),
              ("selective all three", Recompute("selective", modules=MODULES)),
              ("full", Recompute.full()))
ROWS = tuple((name, sp) for sp in (False, True) for name, _ in RECOMPUTES)  # the table's rows, in order


@dataclass(frozen=True)
class Spec:
    model: ModelConfig
    micro_batch_size: int
    seq_length: int
    iters: int
    warmup_iters: int
    seed: int = 1234


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))


def _peak_bytes(prof) -> int:
    """The most CPU tensor memory live at once during a profiled region, above what was live at its start: the
    running sum of the profiler's allocation (+) and free (-) records, in time order."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: the profiler's C++ side logs every start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class Variant:
    def __init__(self, name: str, recompute: Recompute, sp: bool, topology, spec: Spec):
        from codegeex_train.model import CodeGeeXModel, ModelGroups
        from codegeex_train.tensor_parallel import model_parallel_seed
        from codegeex_train.training.engine import build_engine

        self.name, self.sp, self.spec = name, sp, spec
        self.tracker = model_parallel_seed(spec.seed, topology.tp_rank)  # same weights in every variant
        plan = ParallelPlan.derive(topology.dims, micro_batch_size=spec.micro_batch_size,
                                   num_layers=spec.model.num_layers, sequence_parallel=sp, recompute=recompute,
                                   seq_length=spec.seq_length, hidden_size=spec.model.hidden_size)
        model = CodeGeeXModel(spec.model, ModelGroups.from_topology(topology), plan, self.tracker, seed=spec.seed)
        train = TrainConfig(micro_batch_size=spec.micro_batch_size, seq_length=spec.seq_length, zero_stage=2,
                            train_iters=spec.iters + spec.warmup_iters + 1, seed=spec.seed)
        optim = OptimConfig(lr=3e-4, lr_decay_style="constant")
        args = Args(spec.model, ParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=sp), train, optim,
                    DataConfig(), LoggingConfig())
        # ZeRO-2 allocates its whole reduce bucket at every backward: one bucket of this rank's parameters, so that
        # the bucket is the gradients' size (DeepSpeed's default 5e8 elements would be 1.9 GB of every peak here).
        self.params = sum(p.numel() for p in model.parameters())
        zero = {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False,
                                      "reduce_bucket_size": self.params, "allgather_bucket_size": self.params}}
        config = build_deepspeed_config(args, plan, zero)
        self.engine = build_engine(model, optim, train.train_iters, config, topology)
        self.times: list[list[float]] = []
        self.losses: list[float] = []
        self.saved_bytes = self.peak_rss_bytes = self.peak_tensor_bytes = 0

    def iteration(self, ids, labels, index: int, record: bool, measure: bool) -> None:
        from codegeex_train.accounting.memory import SavedActivations

        torch.manual_seed(self.spec.seed + 7919 * index)  # the default stream: the same in every variant
        position_ids = torch.arange(ids.shape[1]).expand_as(ids)
        saved = SavedActivations(self.engine.module) if measure else None
        dist.barrier()
        if measure:
            _reset_peak_rss()
            rss0 = _status_kb("VmRSS")
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) \
            if measure else contextlib.nullcontext()
        c0, t0 = time.process_time(), time.perf_counter()
        with _quiet_stderr() if measure else contextlib.nullcontext(), profiler:
            with saved if saved is not None else contextlib.nullcontext():
                loss = self.engine(ids, position_ids, labels=labels).mean()
            t1 = time.perf_counter()
            self.engine.backward(loss)
        t2 = time.perf_counter()
        if measure:
            self.saved_bytes = saved.bytes
            self.peak_rss_bytes = 1024 * (_status_kb("VmHWM") - rss0)
            self.peak_tensor_bytes = _peak_bytes(profiler)
        self.engine.step()
        t3, c3 = time.perf_counter(), time.process_time()
        if record:
            self.times.append([t1 - t0, t2 - t1, t3 - t2, t3 - t0, c3 - c0])
        self.losses.append(loss.item())


def bench_rank(topology, *, spec: Spec) -> dict | None:
    import deepspeed
    from deepspeed.utils import groups

    from codegeex_train.distributed.malloc import fix_malloc_thresholds
    from codegeex_train.pretrain import skip_inference_comm_op

    skip_inference_comm_op()  # as pretrain.main does: no JIT build of an op training never calls (40-75 s fresh)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # ZeRO's all_gather_into_tensor, every step
    fix_malloc_thresholds()  # as pretrain.main does on CPU: large tensors come from (and go back to) mmap
    wall0, cpu0 = time.perf_counter(), time.process_time()
    variants = [Variant(name, dict(RECOMPUTES)[name], sp, topology, spec) for name, sp in ROWS]
    groups.mpu = variants[0].engine.mpu  # the same TP 2 x DP 1 groups for every engine
    torch.set_num_threads(1)
    data = torch.Generator().manual_seed(spec.seed)  # same on both TP ranks (DP 1)
    measured_at = spec.warmup_iters  # one untimed iteration after the warm-up: the memory
    built_s = time.perf_counter() - wall0
    for i in range(spec.warmup_iters + 1 + spec.iters):
        tokens = torch.randint(spec.model.vocab_size, (spec.micro_batch_size, spec.seq_length + 1), generator=data)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        for v in (variants if i % 2 == 0 else variants[::-1]):
            v.iteration(ids, labels, i, record=i > measured_at, measure=i == measured_at)
    # Per variant: the slowest rank's phase times, the larger rank's memory.
    times = torch.tensor([v.times for v in variants], dtype=torch.float64)  # (variants, iters, phases)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    memory = torch.tensor([[v.saved_bytes, v.peak_tensor_bytes, v.peak_rss_bytes] for v in variants],
                          dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    # This rank's CPU time against its wall time: on a machine shared with other work the ranks get less than a
    # core each, and every time above stretches with it.
    usage = torch.tensor([time.perf_counter() - wall0, time.process_time() - cpu0, built_s], dtype=torch.float64)
    dist.all_reduce(usage, op=dist.ReduceOp.MAX)
    if topology.rank != 0:
        return None
    tokens = spec.micro_batch_size * spec.seq_length
    rows = []
    for k, v in enumerate(variants):
        med = times[k].median(dim=0).values.tolist()
        rows.append({"recompute": v.name, "sp": v.sp, "step_s": med[3], "forward_s": med[0], "backward_s": med[1],
                     "optimizer_s": med[2], "step_cpu_s": med[4], "tokens_per_s": tokens / med[3],
                     "iteration_s": times[k][:, 3].tolist(), "saved_bytes": int(memory[k, 0]),
                     "peak_tensor_bytes": int(memory[k, 1]), "peak_rss_delta_bytes": int(memory[k, 2]),
                     "losses": v.losses})
    for r in rows:  # ratios against "none" of the same SP setting, measured in this run
        base = next(b for b in rows if b["sp"] == r["sp"] and b["recompute"] == "none")
        r["overhead"] = r["step_s"] / base["step_s"] - 1
        r["cpu_overhead"] = r["step_cpu_s"] / base["step_cpu_s"] - 1
        r["saved_vs_none"] = r["saved_bytes"] / base["saved_bytes"]
        r["peak_vs_none"] = r["peak_tensor_bytes"] / base["peak_tensor_bytes"]
        r["max_loss_diff_vs_none"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
    wall_s, cpu_s, build_s = usage.tolist()
    return {"rows": rows, "threads_per_rank": torch.get_num_threads(), "peak_rss_reset": _reset_peak_rss(),
            "params_per_rank": variants[0].params,
            "rank_wall_s": wall_s, "rank_cpu_s": cpu_s, "build_s": build_s}


def table(result: dict) -> str:
    rows = result["rows"]
    header = (f"  {'recompute':20} {'SP':>3} {'step ms':>8} {'tokens/s':>9} {'overhead':>9} {'CPU ms':>7} "
              f"{'CPU ovh':>8} {'saved MB':>9} {'/none':>6} {'peak MB':>8} {'/none':>6} {'RSS +MB':>8} "
              f"{'max |dloss|':>11}")
    lines = [header]
    for r in rows:
        lines.append(f"  {r['recompute']:20} {'on' if r['sp'] else 'off':>3} {1e3 * r['step_s']:8.0f} "
                     f"{r['tokens_per_s']:9.0f} {100 * r['overhead']:+8.1f}% {1e3 * r['step_cpu_s']:7.0f} "
                     f"{100 * r['cpu_overhead']:+7.1f}% {r['saved_bytes'] / 2**20:9.1f} {r['saved_vs_none']:6.2f} "
                     f"{r['peak_tensor_bytes'] / 2**20:8.1f} {r['peak_vs_none']:6.2f} "
                     f"{r['peak_rss_delta_bytes'] / 2**20:8.1f} {r['max_loss_diff_vs_none']:11.1e}")
    by = {(r["recompute"], r["sp"]): r for r in rows}
    sp_saved = " / ".join(f"{by[(n, True)]['saved_bytes'] / by[(n, False)]['saved_bytes']:.2f}" for n, _ in RECOMPUTES)
    sp_speed = " / ".join(f"{by[(n, True)]['tokens_per_s'] / by[(n, False)]['tokens_per_s']:.2f}"
                          for n, _ in RECOMPUTES)
    lines.append(f"  SP on / off ({' / '.join(n for n, _ in RECOMPUTES)}): saved MB {sp_saved}; tokens/s {sp_speed}")
    return "\n".join(lines)


def paper_ratios(model: ModelConfig, seq_length: int, t: int = TP) -> dict[str, float]:
    """Korthikanti et al. 2022, activation bytes per layer in units of sbh (fp16): TP alone 10 + 24/t + 5as/(ht),
    TP + SP 34/t + 5as/(ht), selective without SP 10 + 24/t, with SP 34/t; full recompute keeps the layer input,
    2 (2/t split by SP). As ratios: each mode to none (same SP), and SP on to off (same mode)."""
    attention = 5 * model.num_attention_heads * seq_length / (model.hidden_size * t)
    keep = {("none", False): 10 + 24 / t + attention, ("none", True): 34 / t + attention,
            ("selective", False): 10 + 24 / t, ("selective", True): 34 / t, ("full", False): 2.0, ("full", True): 2 / t}
    out = {f"{mode}/none SP {'on' if sp else 'off'}": keep[(mode, sp)] / keep[("none", sp)]
           for mode in ("selective", "full") for sp in (False, True)}
    out.update({f"SP on/off {mode}": keep[(mode, True)] / keep[(mode, False)] for mode in ("none", "selective")})
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4, help="regular layers (the top query layer comes on top)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=1024, help="random tokens in [0, V); a multiple of 128")
    p.add_argument("--seq-length", type=int, default=512, help="divisible by TP 2 (sequence parallelism)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout; > 0 keeps CPU SDPA on "
                   "its math path (the s x s probabilities kept)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per variant (the median is reported)")
    p.add_argument("--warmup-iters", type=int, default=1, help="untimed iterations per variant first; then one "
                   "more, untimed, measures the memory")
    p.add_argument("--json", metavar="PATH", help="also write the rows (and the run's settings) as JSON")
    a = p.parse_args(argv)
    if a.seq_length % TP:
        p.error(f"--seq-length {a.seq_length} must divide by TP {TP} (sequence parallelism splits it)")
    if a.iters < 1 or a.warmup_iters < 0:
        p.error("--iters must be at least 1 and --warmup-iters at least 0")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    # Before the ranks import DeepSpeed (they inherit these): its CPU accelerator, this checkout's JIT op cache.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".cache", "torch_extensions"))
    from codegeex_train.distributed.spawn import run_distributed
    from codegeex_train.layout.dims import ParallelDims

    cfg = ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                      max_position_embeddings=a.seq_length, hidden_dropout=a.dropout, attention_dropout=a.dropout,
                      activation="fast_gelu", top_query_layer=True, vocab_size=a.vocab_size)
    cfg.validate(TP)
    spec = Spec(cfg, a.micro_batch_size, a.seq_length, a.iters, a.warmup_iters)
    head = (f"model: {cfg.num_layers} layers + top query layer, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
            f"heads, vocab {cfg.padded_vocab_size}, seq {a.seq_length}, micro batch {a.micro_batch_size}, dropout "
            f"{a.dropout:g} (attention: CPU SDPA {'math path, s x s kept' if a.dropout > 0 else 'fused kernel'}), "
            f"fast GeLU, fp32, ZeRO-2; TP {TP} x DP 1 on 2 gloo ranks; {a.warmup_iters} warm-up + 1 memory + "
            f"{a.iters} timed iterations per variant, interleaved")
    print(head, flush=True)
    t0 = time.perf_counter()
    result = run_distributed(bench_rank, ParallelDims(TP, TP), deadline_s=900.0, collective_timeout_s=300.0,
                             spec=spec)[0]
    wall = time.perf_counter() - t0
    print(f"\nrecompute and sequence parallelism, TP {TP} ({result['threads_per_rank']} thread(s) per rank; overhead "
          f"and saved/none against 'none' with the same SP; memory: the larger rank's; run {wall:.0f} s, of which "
          f"{result['build_s']:.0f} s building the engines; a rank used {result['rank_cpu_s']:.0f} s of CPU in "
          f"{result['rank_wall_s']:.0f} s):")
    print(table(result), flush=True)
    paper = paper_ratios(cfg, a.seq_length)
    attention = 5 * cfg.num_attention_heads * a.seq_length / (cfg.hidden_size * TP)
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in paper.items())
    print(f"  paper, per layer (fp16; 5as/(ht) = {attention:g}): {ratios}", flush=True)
    if not result["peak_rss_reset"]:
        print("  (peak RSS could not be reset through /proc/self/clear_refs: its column is the process's peak)")
    if a.json:
        out = {"settings": {k: v for k, v in vars(a).items() if k != "json"}, "tp": TP, "wall_s": wall, "paper": paper,
               "median_iteration_s": statistics.median(r["step_s"] for r in result["rows"]), **result}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return result


if __name__ == "__main__":
    main()
