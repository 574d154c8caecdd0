"""Will the run fit? The memory check ``pretrain.prepare`` runs on the resolved flags, before any process group,
model or dataset exists: ``theory``'s parts per rank at the run's layout, plus what a rank holds beyond its tensors,
against what this host (CPU) or this rank's GPU has free. A run that cannot fit is refused with one line naming the
flags that would make it fit (``--skip-memory-check`` starts it anyway).

What one rank needs (bytes):

  CPU   the tensors resident at the peak, the end of the last forward: weights, gradient partition, optimizer state,
        the activations in flight, recompute's rebuild and the ring attention's block under CP
        (``theory.memory_per_rank``, less the ZeRO reduce bucket: DeepSpeed allocates it in backward, where it fills
        as the activations are freed, and only its touched pages are resident) + FRAMEWORK_BYTES (what a rank's
        RSS grows by after the check beyond its tensors: DeepSpeed's runtime imported at engine build, gloo,
        torch's compiler stack imported at the first step; measured on a model whose tensors are negligible) +
        FRAGMENTATION x the activations when their hidden-state tensors (b s h e) are below glibc's mmap threshold
        (distributed/malloc.py: they come from the heap, which a training step fragments; larger ones are mmapped and
        go back to the system when freed).
        Ranks on one host share its memory: their needs are summed (LOCAL_WORLD_SIZE, LOCAL_SIZE or
        SLURM_NTASKS_PER_NODE ranks per host; all of them without). RLIMIT_AS is per process: a rank's need plus
        ADDRESS_SPACE_BYTES (thread stacks, malloc arenas: address space that is never resident).
  GPU   ``theory.memory_per_rank`` whole + the planner's per-device overhead (CUDA context, NCCL buffers, allocator
        fragmentation: ``planner.Hardware.overhead_gb``) against the free memory of the rank's device; the host
        still holds FRAMEWORK_BYTES per rank (and the optimizer state when ZeRO offloads it).
  Both  the sample index (data/gpt_dataset.py ``build_sample_index``, data/blended_dataset.py), built in memory on
        rank 0's host: 48 bytes per sample and 20 per (document x epoch) at its peak, 10 per sample for a blend.

docs/_issue29_memory.md has the measurements behind the constants (benchmarks/memory_check.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from codegeex_train.accounting import available
from codegeex_train.accounting.planner import Hardware
from codegeex_train.accounting.theory import Workload, memory_per_rank
from codegeex_train.config.arguments import ConfigError, DataConfig, TrainConfig
from codegeex_train.config.model_config import ModelConfig, ModelConfigError
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.recompute import Recompute
from codegeex_train.data.gpt_dataset import parse_data_prefix, split_document_ranges
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.distributed.malloc import THRESHOLD_BYTES
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.errors import LayoutError

GIB = 2**30
FRAMEWORK_BYTES = 170 * 2**20  # measured: 167-175 MiB (benchmarks/memory_check.py, the tiny shape)
FRAGMENTATION = 0.45  # measured: 0.3-0.6 of the heap-allocated activations (the default and PP shapes)
ADDRESS_SPACE_BYTES = GIB  # measured: a CPU rank's VmSize grows 0.15-0.85 GiB more than its RSS
GPU_OVERHEAD_BYTES = int(Hardware.overhead_gb * GIB)
INDEX_BYTES_PER_SAMPLE, INDEX_BYTES_PER_DOCUMENT_EPOCH, BLEND_BYTES_PER_SAMPLE = 48, 20, 10  # measured (tracemalloc)


@dataclass(frozen=True)
class RankNeed:
    """What one rank needs: ``host`` bytes of host memory, ``device`` bytes on its GPU (0 on CPU), by part."""

    host: int
    device: int
    parts: dict[str, int]


def rank_need(w: Workload, pp_rank: int, offload_optimizer: bool = False) -> RankNeed:
    """What a rank of stage ``pp_rank`` needs at its peak (see the module docstring)."""
    p = memory_per_rank(w, pp_rank)
    if w.device == "cpu":
        r = w.tp_size if w.sp else 1
        hidden_tensor = w.plan.micro_batch_size * w.local_seq_length * w.model.hidden_size * w.dtype_bytes // r
        fragmentation = int(FRAGMENTATION * p.activations) if hidden_tensor < THRESHOLD_BYTES else 0
        parts = {"weights": p.weights, "gradients": p.gradients, "optimizer": p.optimizer,
                 "activations": p.activations + p.recompute + p.ring_blocks, "framework": FRAMEWORK_BYTES,
                 "heap fragmentation": fragmentation}
        return RankNeed(host=sum(parts.values()), device=0, parts=parts)
    parts = p.as_dict()
    parts.pop("total")
    parts["overhead"] = GPU_OVERHEAD_BYTES
    host = FRAMEWORK_BYTES + (p.optimizer + p.gradients if offload_optimizer else 0)
    if offload_optimizer:  # ZeRO-Offload keeps the fp32 partition, Adam's moments and the gradients on the host
        parts["optimizer"] = parts["gradients"] = 0
    return RankNeed(host=host, device=sum(parts.values()), parts=parts)


# --------------------------------------------------------------------------------------------- sample index

def _split_index_bytes(sizes, documents: tuple[int, int], seq_length: int, num_samples: int) -> int:
    """``build_sample_index``'s peak for ``num_samples`` over the documents [start, stop): its arithmetic."""
    start, stop = documents
    tokens = int(sizes[start:stop].sum(dtype="int64"))
    if num_samples <= 0 or stop <= start or tokens < 1:
        return 0
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens))
    samples = (epochs * tokens - 1) // seq_length
    return INDEX_BYTES_PER_SAMPLE * samples + INDEX_BYTES_PER_DOCUMENT_EPOCH * epochs * (stop - start)


def sample_index_bytes(data, seq_length: int, num_samples: tuple[int, int, int]) -> int:
    """Bytes the train/valid/test sample indices take while built (``data``: the DataConfig; ``num_samples``:
    training.batches.num_samples's three counts). Unreadable data counts 0: preflight_data names it."""
    total = 0
    try:
        if data.data_path:
            blend = [(w, MMapIndexedDataset(p)) for w, p in parse_data_prefix(data.data_path)]
            ranges = [split_document_ranges(data.split, len(ds)) for _, ds in blend]
            splits = [[(w, ds, r[k]) for (w, ds), r in zip(blend, ranges)] for k in range(3)]
        else:
            splits = [[(w, ds, (0, len(ds))) for w, ds in
                       ((w, MMapIndexedDataset(p)) for w, p in parse_data_prefix(path))] if path else []
                      for path in (data.train_data_path, data.valid_data_path, data.test_data_path)]
    except (OSError, ValueError):
        return 0
    for k, members in enumerate(splits):
        members = [(w, ds, r) for w, ds, r in members if r[1] > r[0] and w > 0]
        n = num_samples[k]
        weight = sum(w for w, _, _ in members)
        if len(members) > 1:
            total += BLEND_BYTES_PER_SAMPLE * n
        for w, ds, r in members:
            share = n if len(members) == 1 else math.ceil(w / weight * n) + 1
            total += _split_index_bytes(ds.sequence_lengths, r, seq_length, share)
    return total


# ------------------------------------------------------------------------------------------------- the check

@dataclass(frozen=True)
class Host:
    """Where this rank runs: its global rank, the ranks of its host, its GPU (None on CPU)."""

    rank: int
    local_world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda"

    @classmethod
    def from_env(cls, world_size: int, device: str, env=os.environ) -> "Host":
        """This rank's place from the launcher's variables (RANK, LOCAL_RANK, the local world size)."""
        return cls(int(env.get("RANK", "0")), available.local_world_size(world_size, env),
                   int(env.get("LOCAL_RANK", "0")), device)

    def ranks(self, world_size: int) -> range:
        node = self.rank // self.local_world_size  # launchers place ranks in blocks of a host's size
        return range(node * self.local_world_size, min(world_size, (node + 1) * self.local_world_size))


@dataclass(frozen=True)
class Shortfall:
    what: str  # "this host", "this process's address space", "GPU 0"
    need: int
    have: available.Available
    detail: str


def _gib(n: int) -> str:
    if n < GIB:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / GIB:.2f} GiB" if n < 1024 * GIB else f"{n / 2**40:.1f} TiB"


def _offloads(ds_config: dict | None) -> bool:
    offload = (ds_config or {}).get("zero_optimization", {}).get("offload_optimizer") or {}
    return isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")


def shortfalls(w: Workload, host: Host, index_bytes: int, memory, offload: bool = False) -> list[Shortfall]:
    """Where ``w`` does not fit: ``memory`` is (shared host memory, per-process address space, GPU), each an
    ``Available`` or None (unknown: not checked)."""
    shared, address_space, gpu = memory
    needs: dict[int, RankNeed] = {}

    def need(rank: int) -> RankNeed:
        pp_rank = w.plan.dims.coords(rank)[2]
        if pp_rank not in needs:
            needs[pp_rank] = rank_need(w, pp_rank, offload)
        return needs[pp_rank]

    ranks = host.ranks(w.plan.dims.world_size)
    index = index_bytes if 0 in ranks else 0  # rank 0 builds the indices; the others map its cache files
    mine = need(host.rank)
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in mine.parts.items() if v)
    out = []
    host_need = sum(need(r).host for r in ranks) + index
    index_text = f"; sample index {_gib(index)}" if index >= 2**20 else ""
    if shared is not None and host_need > shared.bytes:
        per = f"{len(ranks)} ranks, this one {_gib(mine.host)}" if len(ranks) > 1 else "this rank"
        detail = f"({per}: {parts}{index_text})" if host.device == "cpu" else f"({per} on the host{index_text})"
        out.append(Shortfall("this host", host_need, shared, detail))
    if host.device == "cpu" and address_space is not None:
        process_need = mine.host + ADDRESS_SPACE_BYTES + (index if host.rank == 0 else 0)
        if process_need > address_space.bytes:
            out.append(Shortfall("this process's address space", process_need, address_space,
                                 f"({parts}, {_gib(ADDRESS_SPACE_BYTES)} of address space never resident)"))
    if host.device == "cuda" and gpu is not None and mine.device > gpu.bytes:
        out.append(Shortfall(f"GPU {host.local_rank}", mine.device, gpu, f"({parts})"))
    return out


def _variant(w: Workload, tp: int, pp: int, micro: int, recompute: Recompute, sp: bool,
             cp: int | None = None) -> Workload | None:
    """``w`` at another layout (same global batch; an even layer split when PP changes; its CP unless ``cp``), or
    None if training would refuse it."""
    plan = w.plan
    same_stages = pp == plan.dims.pp_size
    try:
        w.model.validate(tp)
        new = ParallelPlan.derive(
            ParallelDims(plan.dims.world_size, tp, pp, plan.dims.cp_size if cp is None else cp),
            micro_batch_size=micro, global_batch_size=plan.global_batch_size, num_layers=w.model.num_layers,
            stage_layers=plan.stage_layers if same_stages and plan.num_chunks == 1 else None,
            num_chunks=plan.num_chunks if same_stages else 1, sequence_parallel=sp, recompute=recompute,
            seq_length=plan.seq_length, hidden_size=plan.hidden_size, dtype=plan.dtype)
    except (LayoutError, ModelConfigError):
        return None
    return replace(w, plan=new)


def _flags(w: Workload, v: Workload) -> str:
    changes = []
    for flag, a, b in (("--tensor-model-parallel-size", w.tp_size, v.tp_size),
                       ("--context-parallel-size", w.cp_size, v.cp_size),
                       ("--pipeline-model-parallel-size", w.pp_size, v.pp_size),
                       ("--micro-batch-size", w.plan.micro_batch_size, v.plan.micro_batch_size)):
        if a != b:
            changes.append(f"{flag} {b}")
    if v.sp and not w.sp:
        changes.append("--sequence-parallel")
    if v.recompute != w.recompute:
        changes.append(f"--recompute-granularity {v.recompute.granularity}")
    return " ".join(changes)


def _divisors(n: int, limit: int = 4096) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def suggestions(w: Workload, host: Host, index_bytes: int, memory, offload: bool = False) -> tuple[list[str], str]:
    """The mildest change of each kind (recompute, sequence parallelism, a smaller micro-batch, a larger TP, a larger
    PP, a larger CP) that makes ``w`` fit, as flags; else all of them at once, if that fits. Second: when nothing
    fits, what the most frugal layout would still need, in words."""
    world, gbs = w.plan.dims.world_size, w.plan.global_batch_size
    tp, pp, micro, rc, sp = w.tp_size, w.pp_size, w.plan.micro_batch_size, w.recompute, w.sp
    tps = [t for t in _divisors(host.local_world_size) if t > tp]  # TP stays inside a host
    pps = [p for p in _divisors(world) if p > pp]
    cps = [c for c in _divisors(world) if c > w.cp_size and c & (c - 1) == 0]  # powers of two, as the planner's
    micros = [b for b in _divisors(gbs // w.plan.dims.dp_size) if b < micro][::-1]  # largest first
    recomputes = [] if rc.is_full else [r for r in (Recompute("selective"), Recompute.full()) if r != rc]
    kinds = ([(tp, pp, micro, r, sp) for r in recomputes], [(tp, pp, micro, rc, True)] if tp > 1 and not sp else [],
             [(tp, pp, b, rc, sp) for b in micros], [(t, pp, micro, rc, sp) for t in tps],
             [(tp, p, micro, rc, sp) for p in pps], [(tp, pp, micro, rc, sp, c) for c in cps])
    found = []
    for options in kinds:
        for option in options:
            v = _variant(w, *option)
            if v is not None and not shortfalls(v, host, index_bytes, memory, offload):
                found.append(_flags(w, v))
                break
    if found:
        return found, ""
    frugal = [v for t in [tp, *tps] for p in [pp, *pps] for c in [w.cp_size, *cps]
              if (v := _variant(w, t, p, min([micro, *micros]), Recompute.full(), True, c)) is not None]
    if not frugal:
        return [], ""

    def deficit(v: Workload) -> tuple[int, Shortfall | None]:
        lacking = shortfalls(v, host, index_bytes, memory, offload)
        worst = max(lacking, key=lambda s: s.need - s.have.bytes, default=None)
        return (worst.need - worst.have.bytes if worst else 0), worst

    best = min(frugal, key=lambda v: deficit(v)[0])
    short, worst = deficit(best)
    if not short:
        return [_flags(w, best)], ""
    return [], f"{_flags(w, best)} would still need {_gib(worst.need)} on {worst.what}"


def check_memory(w: Workload, host: Host, index_bytes: int, ds_config: dict | None, train_iters: int,
                 num_samples: int) -> None:
    """Raise ConfigError (one line: the estimate, what is available, the flags that would make it fit) when ``w``
    does not fit; ``num_samples``: the training samples (--train-iters x global batch), for the sample index."""
    offload = _offloads(ds_config)
    shared, address_space = available.host_memory()
    gpu = available.device_memory(host.local_rank) if host.device == "cuda" else None
    memory = (shared, address_space, gpu)
    lacking = shortfalls(w, host, index_bytes, memory, offload)
    if not lacking:
        return
    s = lacking[0]
    ranks = len(host.ranks(w.plan.dims.world_size))
    shared_by = f", shared by {ranks} ranks" if s.what == "this host" and ranks > 1 else ""
    text = (f"not enough memory: this run needs about {_gib(s.need)} on {s.what} {s.detail} but "
            f"{_gib(s.have.bytes)} is available ({s.have.source}{shared_by})")
    if index_bytes and index_bytes * 2 > s.need:
        text += (f"; the sample index is for --train-iters {train_iters} x global batch "
                 f"{w.plan.global_batch_size} = {num_samples} samples: lower --train-iters")
    else:
        fixes, smallest = suggestions(w, host, index_bytes, memory, offload)
        if fixes:
            text += "; it fits with " + ", or ".join(fixes)
        else:
            world = w.plan.dims.world_size
            text += (f"; no layout of {world} rank{'s' if world > 1 else ''} fits ({smallest or 'none is valid'}): "
                     f"use more devices or hosts, or a smaller model (--num-layers, --hidden-size)")
    raise ConfigError(text + "; --skip-memory-check starts it anyway")


def check_run_memory(model: ModelConfig, plan: ParallelPlan, train: TrainConfig, data: DataConfig, ds_config: dict,
                     num_samples: tuple[int, int, int], host: Host) -> None:
    """The check on a resolved run (its model with the vocabulary, plan, --train-iters, data flags and DeepSpeed
    config; training.batches.num_samples's counts): ConfigError when it cannot fit."""
    w = Workload.from_run(model, plan, ds_config, host.device)
    index = sample_index_bytes(data, plan.seq_length, num_samples)
    check_memory(w, host, index, ds_config, train.train_iters, num_samples[0])
