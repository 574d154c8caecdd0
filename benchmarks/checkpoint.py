"""Checkpoint saves against training: the stall per save, sync against --async-save, and write throughput, in one run.

On the same two gloo ranks (DP 2, ZeRO-2, fp32) one engine trains on random tokens and saves every ``--save-every``
iterations, sync and async saves taking turns (sync first in even rounds, async first in odd ones, so drift on a
shared machine hits both alike). A cycle is one save step and ``--save-every - 1`` plain steps; an async cycle then
waits for its write and commits it (``latest``), so the next cycle starts with nothing in flight.

Per save mode (the slowest rank's times: a save ends in collectives, so every rank waits for the last one):
  stall s      training stall per save: the save call, which training waits for (sync: serialization, write,
               fsync, commit; async: the host snapshot), the median over the saves;
  step excess  the same seen in step times: the save step (step + save call) minus the median plain step (no save,
               no write in flight). Steps vary by seconds on a shared machine, so this is the noisier figure;
  write s      the time the files take to write, from the save call to the last file synced (async: in the
               background), per rank, the median over the saves;
  after s      async: the time training still lost to the save after its step: the excess over the median plain
               step of the steps that ran while the write did (on this machine the writer shares the ranks' two
               cores), plus the wait for the write and the commit at the cycle's end;
  GB/s         bytes each rank wrote (the files of the committed tag directory: the model file on DP rank 0, each
               rank's ZeRO partition) / its write time; "total": all bytes / the slowest rank's write time.
The async stall as a fraction of the sync one is the acceptance figure of issue 34 (< 20%). Under the table, the
measured throughput gives CodeGeeX-13B's save per rank (TP 8, PP 1, bf16 weights + fp32 master and Adam moments,
ZeRO-2: the weights written by DP rank 0 of each model-parallel group, 12 bytes per parameter of optimizer state by
every rank) at 64, 512 and 1,536 GPUs against a 30 s SIGTERM-to-SIGKILL window, and the same at --assume-gbps.

The default model holds ~1 GB of ZeRO-2 optimizer state per rank: 13 layers + the top query layer, hidden 1024,
16 heads, vocab 1024 (178 M parameters: 12 bytes x 89 M per rank), seq 64, micro-batch 1 (few tokens per step: the saves
are what is measured). Checkpoints go to a temporary directory (--save-dir: another file system, e.g. a node-local
disk against a shared one); each committed save removes the one before.

    python benchmarks/checkpoint.py             # 1.07 GB of optimizer state per rank: 4-5 min measured (shared cores)
    python benchmarks/checkpoint.py --num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --rounds 1 --save-every 2 --json out.json     # ~10 s (tests/benchmarks/)

Ranks are spawned here (codegeex_train.distributed.spawn.run_distributed), one thread each (and the async writer's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from codegeex_train.config.arguments import Args, DataConfig, LoggingConfig, OptimConfig, ParallelConfig, TrainConfig
from codegeex_train.config.deepspeed import build_deepspeed_config
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this checkout's codegeex_train, whatever else is installed
    sys.path.insert(0, ROOT)

DP = 2
MODES = ("sync", "async")  # the table's rows, in order
KILL_WINDOW_S = 30.0  # SLURM's KillWait default, DeepSpeed's launcher and torchrun: SIGTERM to SIGKILL
GPU_COUNTS = (64, 512, 1536)
PRESET_TP = 8  # CodeGeeX-13B's model parallelism (configs/codegeex-13b.yaml)


@dataclass(frozen=True)
class Spec:
    model: ModelConfig
    micro_batch_size: int
    seq_length: int
    save_every: int
    rounds: int
    warmup_iters: int
    save_dir: str
    seed: int = 1234


def _plain_step(engine, ids, labels) -> None:
    position_ids = torch.arange(ids.shape[1]).expand_as(ids)
    loss = engine(ids, position_ids, labels=labels).mean()
    engine.backward(loss)
    engine.step()


def _rank_files(tag_dir: str, dp_rank: int) -> list[str]:
    """The files of ``tag_dir`` this rank wrote (DP 2, TP 1, PP 1): the model file on DP rank 0, its ZeRO file."""
    from codegeex_train.checkpoint.deepspeed_files import MODEL_FILE, ZERO_FILE

    mine = []
    for name in sorted(os.listdir(tag_dir)):
        zero = ZERO_FILE.match(name)
        if (zero and int(zero.group(1)) == dp_rank) or (MODEL_FILE.match(name) and dp_rank == 0):
            mine.append(name)
    return mine


class _Timed:
    """This rank's file writes, as the checkpoint engine makes them: the time from the save call to the last file
    written and synced (the engine's ``save`` wrapped)."""

    def __init__(self, safe):
        self.last_end = 0.0
        original = safe.save

        def save(state_dict, path):
            original(state_dict, path)
            self.last_end = time.perf_counter()

        safe.save = save


def bench_rank(topology, *, spec: Spec) -> dict | None:
    import deepspeed

    from codegeex_train.checkpoint.deepspeed_checkpoint import install_checkpoint_engine
    from codegeex_train.checkpoint.files import checkpoint_tag, read_latest
    from codegeex_train.checkpoint.manager import CheckpointManager
    from codegeex_train.checkpoint.train_state import TrainState
    from codegeex_train.distributed.malloc import fix_malloc_thresholds
    from codegeex_train.model import CodeGeeXModel, ModelGroups
    from codegeex_train.pretrain import skip_inference_comm_op
    from codegeex_train.tensor_parallel import model_parallel_seed
    from codegeex_train.training.engine import build_engine

    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    fix_malloc_thresholds()  # as pretrain.main does on CPU
    skip_inference_comm_op()  # no JIT build of an op training never calls
    torch.set_num_threads(1)
    tracker = model_parallel_seed(spec.seed, topology.tp_rank)
    model = CodeGeeXModel(spec.model, ModelGroups.from_topology(topology), rng_tracker=tracker, seed=spec.seed)
    params = sum(p.numel() for p in model.parameters())
    iterations = spec.warmup_iters + 2 * spec.rounds * spec.save_every
    train = TrainConfig(micro_batch_size=spec.micro_batch_size, seq_length=spec.seq_length, zero_stage=2,
                        train_iters=iterations, seed=spec.seed, save=spec.save_dir)
    optim = OptimConfig(lr=1e-4, lr_decay_style="constant")
    args = Args(spec.model, ParallelConfig(), train, optim, DataConfig(), LoggingConfig())
    # One reduce bucket of at most 50 M elements (DeepSpeed's default 5e8 would be 2 GB more per rank here).
    bucket = min(params, 50_000_000)
    zero = {"zero_optimization": {"stage": 2, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}}
    plan = ParallelPlan.derive(topology.dims, micro_batch_size=spec.micro_batch_size,
                               num_layers=spec.model.num_layers, seq_length=spec.seq_length,
                               hidden_size=spec.model.hidden_size)
    engine = build_engine(model, optim, iterations, build_deepspeed_config(args, plan, zero), topology)
    timed = _Timed(install_checkpoint_engine(engine))
    # A checkpoint manager per mode, as pretrain.py builds it for --save with and without --async-save (no lock, no
    # retention: `committed` below removes the older tags).
    managers = {mode: CheckpointManager(spec.save_dir, async_save=mode == "async") for mode in MODES}
    for manager in managers.values():
        manager.attach(engine, spec.model, topology, tracker)
    data = torch.Generator().manual_seed(spec.seed + topology.dp_rank)
    state = TrainState()

    def step() -> None:
        tokens = torch.randint(spec.model.vocab_size, (spec.micro_batch_size, spec.seq_length + 1), generator=data)
        _plain_step(engine, tokens[:, :-1], tokens[:, 1:])
        state.iteration += 1
        state.consumed_train_samples += spec.micro_batch_size * DP

    def committed(tag: str) -> None:
        """After ``latest`` names ``tag``: this rank's bytes, then the tag before it removed (disk space)."""
        dist.barrier()
        if read_latest(spec.save_dir) != tag:
            raise RuntimeError(f"{spec.save_dir}: 'latest' does not name {tag} after its save")
        tag_dir = os.path.join(spec.save_dir, tag)
        written.append(sum(os.path.getsize(os.path.join(tag_dir, n)) for n in _rank_files(tag_dir, topology.dp_rank)))
        dist.barrier()
        if topology.rank == 0:
            for old in os.listdir(spec.save_dir):
                if old.startswith("iter_") and old != tag:
                    shutil.rmtree(os.path.join(spec.save_dir, old), ignore_errors=True)

    # Per step: seconds, and whether an async write was in flight when it started; per save: its mode, blocking s,
    # write s, end wait s and the index of its step.
    step_s: list[float] = []
    writing: list[bool] = []
    saves: list[list[float]] = []
    written: list[int] = []
    for _ in range(spec.warmup_iters):
        step()
    for r in range(spec.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            manager = managers[mode]
            manager.save(state)
            t2 = time.perf_counter()
            step_s.append(t2 - t0)
            writing.append(False)
            for _ in range(spec.save_every - 1):
                writing.append(manager.writing)
                t3 = time.perf_counter()
                step()
                manager.commit(wait=False)  # as at every step boundary of training: commits once all wrote
                step_s.append(time.perf_counter() - t3)
            t4 = time.perf_counter()
            manager.finish()  # the cycle's end: nothing in flight for the next one
            t5 = time.perf_counter()
            write_s = manager.last_write_seconds if mode == "async" else timed.last_end - t1
            committed(checkpoint_tag(state.iteration - spec.save_every + 1))
            saves.append([MODES.index(mode), t2 - t1, write_s, t5 - t4, len(step_s) - spec.save_every])
    # The slowest rank's view of each step and save (they are collective-bound: all ranks end them together).
    steps = torch.tensor(step_s, dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    busy = torch.tensor(writing, dtype=torch.int32)
    dist.all_reduce(busy, op=dist.ReduceOp.MAX)  # a write in flight on any rank
    save_steps = {int(s[4]) for s in saves}
    kind = ["save" if i in save_steps else "writing" if busy[i] else "plain" for i in range(len(step_s))]
    table = torch.tensor(saves, dtype=torch.float64)
    timing = table[:, 1:4].clone()
    dist.all_reduce(timing, op=dist.ReduceOp.MAX)
    # Per rank: bytes and write seconds of every save (for the per-rank throughput).
    per_rank = torch.zeros(DP, len(saves), 2, dtype=torch.float64)
    per_rank[topology.dp_rank, :, 0] = torch.tensor(written, dtype=torch.float64)
    per_rank[topology.dp_rank, :, 1] = table[:, 2]
    dist.all_reduce(per_rank)
    if topology.rank != 0:
        return None
    plain = [s for s, k in zip(steps.tolist(), kind) if k == "plain"]
    base = statistics.median(plain)
    rows = []
    for m, mode in enumerate(MODES):
        picks = [i for i in range(len(saves)) if int(table[i, 0]) == m]
        excess = [steps[int(table[i, 4])].item() - base for i in picks]
        blocking = timing[picks, 0].tolist()
        after = []
        for i in picks:  # the excess of the steps that ran while this save's write did, and the end wait
            first = int(table[i, 4])
            during = [steps[j].item() - base for j in range(first + 1, first + spec.save_every) if kind[j] == "writing"]
            after.append(sum(during) + timing[i, 2].item())
        rank_bytes = [per_rank[d, picks, 0].tolist() for d in range(DP)]
        rank_write = [per_rank[d, picks, 1].tolist() for d in range(DP)]
        rows.append({
            "mode": mode, "saves": len(picks), "stall_s": statistics.median(blocking), "stall_each_s": blocking,
            "step_excess_s": statistics.median(excess), "step_excess_each_s": excess,
            "write_s": [statistics.median(w) for w in rank_write],
            "after_s": statistics.median(after) if mode == "async" else 0.0,
            "bytes_per_rank": [int(statistics.median(b)) for b in rank_bytes],
            "gbps_per_rank": [statistics.median(b / w / 1e9 for b, w in zip(bs, ws))
                              for bs, ws in zip(rank_bytes, rank_write)],
            "gbps_total": statistics.median(sum(per_rank[:, i, 0].tolist()) / max(per_rank[:, i, 1].tolist()) / 1e9
                                            for i in picks)})
    sync, async_ = rows
    return {"rows": rows, "plain_step_s": base, "plain_steps": len(plain), "warmup_steps": spec.warmup_iters,
            "parameters": params, "optimizer_bytes_per_rank": 12 * -(-params // DP),
            "async_over_sync_stall": async_["stall_s"] / sync["stall_s"]}


def projection(gbps: float, dtype_bytes: int = 2) -> list[dict]:
    """CodeGeeX-13B's save per rank at ``GPU_COUNTS`` (TP 8, PP 1, ZeRO-2) if each rank writes at ``gbps`` GB/s:
    DP rank 0 of each model-parallel group writes its TP shard of the weights (``dtype_bytes`` per parameter) and its
    optimizer partition (fp32 master + two Adam moments: 12 bytes per parameter of its 1/DP share), every other rank
    its partition only."""
    from codegeex_train.accounting.planner import from_preset
    from codegeex_train.accounting.theory import Workload, stage_parameters
    from codegeex_train.layout.dims import ParallelDims

    model, _, settings = from_preset("codegeex-13b")
    out = []
    for gpus in GPU_COUNTS:
        dims = ParallelDims(gpus, PRESET_TP)
        plan = ParallelPlan.derive(dims, micro_batch_size=1, num_layers=model.num_layers,
                                   seq_length=settings["seq_length"], hidden_size=model.hidden_size,
                                   dtype="bf16" if dtype_bytes == 2 else "fp32")
        psi = stage_parameters(Workload(model, plan), 0)  # per TP rank
        shard = 12 * -(-psi // dims.dp_size)
        busiest = dtype_bytes * psi + shard
        out.append({"gpus": gpus, "dp": dims.dp_size, "parameters_per_tp_rank": psi,
                    "total_bytes": PRESET_TP * (dtype_bytes * psi + dims.dp_size * shard),
                    "busiest_rank_bytes": busiest, "other_rank_bytes": shard,
                    "busiest_node_bytes": PRESET_TP * busiest,  # 8 GPUs a node: one TP group, DP rank 0
                    "busiest_rank_s": busiest / (gbps * 1e9), "other_rank_s": shard / (gbps * 1e9)})
    return out


def table(result: dict) -> str:
    lines = [f"  {'mode':6} {'saves':>5} {'stall s':>8} {'step excess s':>13} {'after s':>8} "
             f"{'write s (r0/r1)':>16} {'GB (r0/r1)':>11} {'GB/s (r0/r1)':>13} {'GB/s total':>10}"]
    for r in result["rows"]:
        lines.append(f"  {r['mode']:6} {r['saves']:5d} {r['stall_s']:8.3f} {r['step_excess_s']:13.3f} "
                     f"{r['after_s']:8.3f} {r['write_s'][0]:7.2f}/{r['write_s'][1]:<8.2f} "
                     f"{r['bytes_per_rank'][0] / 1e9:5.2f}/{r['bytes_per_rank'][1] / 1e9:<5.2f} "
                     f"{r['gbps_per_rank'][0]:6.2f}/{r['gbps_per_rank'][1]:<6.2f} {r['gbps_total']:10.2f}")
    lines.append(f"  async stall / sync stall: {result['async_over_sync_stall']:.3f} (issue 34's acceptance: < 0.2)")
    return "\n".join(lines)


def projection_table(rates: dict[str, float]) -> str:
    """The 13B save per rank at each rate in ``rates`` (label -> GB/s per rank)."""
    lines = [f"  {'GPUs':>5} {'DP':>4} {'rank 0 GB':>9} {'others GB':>9} {'node 0 GB':>9} {'job GB':>7}  "
             + "  ".join(f"{label + ' rank 0 / others s':>30}" for label in rates)]
    for i, gpus in enumerate(GPU_COUNTS):
        rows = [projection(gbps)[i] for gbps in rates.values()]
        cells = "  ".join(f"{r['busiest_rank_s']:13.1f} / {r['other_rank_s']:<6.1f}"
                          f"{' fits' if r['busiest_rank_s'] < KILL_WINDOW_S else ' over':>10}" for r in rows)
        lines.append(f"  {gpus:5d} {rows[0]['dp']:4d} {rows[0]['busiest_rank_bytes'] / 1e9:9.2f} "
                     f"{rows[0]['other_rank_bytes'] / 1e9:9.2f} {rows[0]['busiest_node_bytes'] / 1e9:9.1f} "
                     f"{rows[0]['total_bytes'] / 1e9:7.1f}  {cells}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=13, help="regular layers (the top query layer comes on top)")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=1024, help="random tokens in [0, V); a multiple of 128")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--save-every", type=int, default=4, help="iterations per cycle: a save step and N - 1 plain "
                   "ones (the async write runs during those)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one sync and one async cycle each")
    p.add_argument("--warmup-iters", type=int, default=2, help="untimed iterations first")
    p.add_argument("--save-dir", metavar="DIR", help="where the checkpoints go (default: a temporary directory, "
                   "removed at the end); must not hold a 'latest'")
    p.add_argument("--assume-gbps", type=float, default=2.0, help="a per-rank write rate to project CodeGeeX-13B's "
                   "save at, beside the measured one")
    p.add_argument("--json", metavar="PATH", help="also write the rows (and the run's settings) as JSON")
    a = p.parse_args(argv)
    if a.save_every < 2 or a.rounds < 1 or a.warmup_iters < 1:
        p.error("--save-every must be at least 2 (a save step and a plain one), --rounds and --warmup-iters at "
                "least 1 (the plain steps' median needs a warm engine)")
    if a.save_dir and os.path.lexists(os.path.join(a.save_dir, "latest")):
        p.error(f"--save-dir {a.save_dir} holds a 'latest': give an empty directory (the benchmark removes the "
                f"checkpoints it writes)")
    if a.assume_gbps <= 0:
        p.error("--assume-gbps must be > 0 (GB/s per rank)")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
    from codegeex_train.distributed.spawn import run_distributed
    from codegeex_train.layout.dims import ParallelDims

    cfg = ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                      max_position_embeddings=a.seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                      activation="fast_gelu", top_query_layer=True, vocab_size=a.vocab_size)
    cfg.validate(1)
    save_dir = a.save_dir or tempfile.mkdtemp(prefix="checkpoint-bench-")
    spec = Spec(cfg, a.micro_batch_size, a.seq_length, a.save_every, a.rounds, a.warmup_iters, save_dir)
    print(f"model: {cfg.num_layers} layers + top query layer, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
          f"heads, vocab {cfg.padded_vocab_size}, seq {a.seq_length}, micro batch {a.micro_batch_size}, fp32, ZeRO-2, "
          f"DP {DP} on 2 gloo ranks; {a.warmup_iters} warm-up iterations, then {a.rounds} round(s) of a sync and an "
          f"async cycle of {a.save_every} iterations (a save, then {a.save_every - 1} plain); checkpoints in "
          f"{save_dir}", flush=True)
    t0 = time.perf_counter()
    try:
        result = run_distributed(bench_rank, ParallelDims(DP), deadline_s=1800.0, collective_timeout_s=600.0,
                                 spec=spec)[0]
    finally:
        if not a.save_dir:
            shutil.rmtree(save_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    measured = min(result["rows"][0]["gbps_per_rank"])  # sync: the rank that wrote the slowest
    result["projection"] = {"measured_gbps": measured, "measured": projection(measured),
                            "assumed_gbps": a.assume_gbps, "assumed": projection(a.assume_gbps)}
    print(f"\ncheckpoint saves, sync against async ({result['parameters'] / 1e6:.3g} M parameters, "
          f"{result['optimizer_bytes_per_rank'] / 1e9:.3g} GB of ZeRO-2 optimizer state per rank; plain step "
          f"{result['plain_step_s']:.3f} s, the median of {result['plain_steps']}; the slowest rank's times; run "
          f"{wall:.0f} s):")
    print(table(result), flush=True)
    print(f"\nCodeGeeX-13B, TP {PRESET_TP} x PP 1, ZeRO-2, bf16 weights (rank 0: DP rank 0 of a model-parallel group, "
          f"weights + its optimizer share; others: the share): seconds per rank to write against the "
          f"{KILL_WINDOW_S:.0f} s kill window")
    print(projection_table({f"measured {measured:.2f} GB/s": measured, f"at {a.assume_gbps:g} GB/s": a.assume_gbps}),
          flush=True)
    if a.json:
        out = {"settings": {k: v for k, v in vars(a).items() if k != "json"}, "dp": DP, "wall_s": wall, **result}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return result


if __name__ == "__main__":
    main()
