"""Layout planner: which (TP, CP, PP, interleaving, DP, micro-batch, sequence parallelism, recompute) to use on a
cluster, from the shapes alone, before any GPU is booked.

    python -m codegeex_train.accounting.planner --config codegeex-13b --world-size 1536 --gpus-per-node 8 --gpu-memory-gb 32
    python -m codegeex_train.accounting.planner --num-layers 39 --hidden-size 5120 --num-attention-heads 40 \\
        --vocab-size 52224 --seq-length 2048 --global-batch-size 1536 --world-size 1536 [--top 20]
    python -m codegeex_train.accounting.planner --config qwen2.5-coder-7b --seq-length 16384 --global-batch-size 256

The model's architecture options (grouped-query attention, SwiGLU, RMSNorm, the untied output layer, the bias
switches: training's flags, or a preset's model: section) enter through ``theory``'s formulas and ``model.flops``;
TP sizes that do not divide the key-value groups are not listed (training refuses them), and --tensor-model-parallel-
size naming one is refused with training's own line.

Memory and bytes per step come from ``accounting.theory`` (the formulas the runs are checked against), FLOPs
from ``model.flops``, layer splits from ``pipeline.stages`` (what ``--decoder-first/last-pipeline-num-layers``
would give training). The step-time estimate is a model, not a measurement; its assumptions:

* compute: every GEMM runs at ``--efficiency`` x ``--peak-tflops`` (one number for all shapes: small
  micro-batches and high TP make GEMMs thinner and slower in reality, which this does not see); full recompute
  adds the recomputed layers' forward, selective recompute the attention core's forward only (QK^T and x V,
  4 b s^2 h per layer), since its other choices (activation, LayerNorms) are elementwise;
* sequence parallelism changes no FLOP: the LayerNorms and dropouts it splits are not counted;
* 1F1B pipeline: a step takes (m + p - 1) x the slowest stage's time per micro-batch, so the parts are the
  ideal compute, the stage imbalance (slowest stage minus the mean, m times) and the bubble ((p - 1) times
  the slowest stage; bubble fraction (p - 1) / m as Megatron reports it); interleaved 1F1B with v model chunks
  per rank (``--num-layers-per-virtual-pipeline-stage``, where Megatron allows it: PP > 1, the layers split
  evenly into p x v chunks, m divisible by p) shrinks the bubble to (p - 1) / v slowest-stage times (fraction
  (p - 1) / (v m)) for v times the PP bytes and more activations in flight (``theory.activations_in_flight``);
* TP all-reduces and PP sends are blocking in Megatron's schedule: on the critical path of every micro-batch;
  under SP so are the all-gathers and reduce-scatters that replace them and the re-gathers in backward;
* context parallelism (CP n, ``--context-parallel-size``): each rank computes 1/n of every sequence's tokens (the
  FLOPs / (t n)); every attention is a ring of n steps whose K/V hop (2 b (s/n) kv e / t bytes, kv = g d the
  key-value channels, h without GQA, one way round the
  ring, over the slower link of its TP x CP block of ranks) is posted before the step's block is computed, so a
  hop costs only what exceeds its block: the own block (step 0: s/n x s/n scores per head, 4 b (s/n)^2 h / t
  FLOPs forward) or a later one (half that), backward twice the forward's FLOPs and carrying K/V and dK/dV (two
  hops a step), its last dK/dV hop exposed; re-run forwards (recompute) hide the same way. The ring computes the
  masked half of its own block (the FLOP count's s^2 attention covers that). CP is listed when each rank keeps at
  least ``MIN_CP_TOKENS`` tokens of a sequence;
* collectives run as rings: a group of g ranks moves (g - 1) / g of the bytes ``theory`` counts per rank
  over the slowest link in the group (intra-node if the group sits in one node, else inter-node);
* DP (ZeRO-2, ``overlap_comm``): gradient reduce-scatters hide behind backward compute up to its length
  (the last bucket never does); the all-gather of updated weights after the step is exposed; under CP these run
  over DP x CP (DeepSpeed's group then), a ring of d n ranks;
* the tied word-embedding all-reduce (first and last stage) runs after the flush: exposed (untied: none);
* memory: the worst stage of ``theory.memory_per_rank`` plus ``--overhead-gb`` (CUDA context, NCCL buffers,
  allocator fragmentation), compared with ``--gpu-memory-gb``; memory is in GiB (a "32 GB" device has 32 GiB),
  traffic in GB (10^9 bytes) like link speeds.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields
from functools import lru_cache
from itertools import accumulate

from codegeex_train.accounting.theory import (
    Workload,
    comm_bytes_per_step,
    dp_allgather_bytes,
    memory_per_rank,
    recomputed_attentions,
    stage_parameters,
)
from codegeex_train.config.config_file import PLANNER_SECTION, ConfigFileError, known_keys, preset_path, section
from codegeex_train.config.model_config import NORMALIZATIONS, ModelConfig, ModelConfigError
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.errors import LayoutError
from codegeex_train.layout.plan import ParallelPlan, context_parallel_chunk_length
from codegeex_train.layout.recompute import Recompute
from codegeex_train.model.flops import model_layer_forward_flops
from codegeex_train.layout.stages import stage_layer_counts

GIB = 2**30
# CP is listed when a rank keeps at least this many tokens of a sequence: below it a ring step's block (2 b (s/n)^2 h/t
# FLOPs) cannot hide its K/V hop (2 b (s/n) h e/t bytes) on any link (they balance at s/n = e x FLOP/s / link bytes/s,
# ~1,000 tokens on NVLink at A100 rates, ~8,000 on CodeGeeX's preset), and such sequences need no CP for memory.
MIN_CP_TOKENS = 1024

# Presets are the training presets, configs/NAME.yaml (config/config_file.py; also read by scripts/pretrain_codegen.sh
# and benchmarks/gpu.py): the shape and architecture from model: (every ModelConfig field it sets: GQA, SwiGLU,
# RMSNorm, the untied output layer and the bias switches change the estimate; RoPE scaling, the window and the epsilon
# are read and checked, and change nothing here), the sequence and global batch from train:, and from planner: the
# tokenizer's vocabulary, the compute dtype and the cluster (codegeex-13b: CodeGeeX's 1,536 Ascend 910, the file
# cites its sources).
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig) if f.init and f.name != "vocab_size")
PRESET_KEYS = {
    "model": MODEL_KEYS,
    "train": ("seq_length", "global_batch_size"),
    PLANNER_SECTION: ("vocab_size", "dtype", "world_size", "gpus_per_node", "gpu_memory_gb", "peak_tflops",
                      "intra_node_gbps", "inter_node_gbps", "efficiency", "overhead_gb", "fused_attention"),
}


def preset_values(name: str) -> dict:
    """The planner's values (its flags' names, underscored) of a preset (configs/NAME.yaml) or a config file;
    ConfigFileError for a missing file or an unknown key in its planner: section."""
    path = preset_path(name)
    values = {}
    model_fields = known_keys({"model": ModelConfig})["model"]  # a field's every spelling (norm_epsilon, ...)
    for name_, keys in PRESET_KEYS.items():
        given = {str(k).replace("-", "_"): v for k, v in section(path, name_).items()}
        if name_ == "model":
            given = {model_fields[k].name if k in model_fields else k: v for k, v in given.items()}
        unknown = sorted(set(given) - set(keys)) if name_ == PLANNER_SECTION else []
        if unknown:
            raise ConfigFileError(f"--config {path}: unknown key {PLANNER_SECTION}.{unknown[0]} (it holds "
                                  f"{', '.join(keys)})")
        values.update({k: given[k] for k in keys if given.get(k) is not None})
    if "top_query_layer" in values:
        values["no_top_query_layer"] = not values.pop("top_query_layer")
    return values


def _model(values: dict) -> ModelConfig:
    """The model of the planner's values; ModelConfigError for switches that do not go together."""
    given = {k: values[k] for k in MODEL_KEYS if k in values and k != "top_query_layer"}
    given.setdefault("max_position_embeddings", values["seq_length"])
    model = ModelConfig(**given, top_query_layer=not values.get("no_top_query_layer", False),
                        vocab_size=values["vocab_size"])
    model.check_architecture()
    return model


def describe_model(model: ModelConfig) -> str:
    """The shape in one phrase, with the architecture options that are not CodeGeeX's."""
    attention = (f"{model.num_attention_heads} heads ({model.kv_groups} KV groups)" if model.group_query_attention
                 else f"{model.num_attention_heads} heads")
    options = [model.normalization] if model.normalization != "LayerNorm" else []
    options += ["SwiGLU"] if model.swiglu else []
    options += ["untied output layer"] if not model.tied_output else []
    options += ["no linear biases" + (" but QKV's" if model.qkv_bias else "")] if model.disable_bias_linear else []
    options += [f"window {model.window_size}"] if model.window_size else []
    return (f"{model.num_layers} layers{' + top query layer' if model.top_query_layer else ''}, h {model.hidden_size}, "
            f"{attention}, ffn {model.ffn_hidden_size}{''.join(', ' + o for o in options)}, "
            f"vocab {model.padded_vocab_size} (padded)")


def _cluster(values: dict) -> "Hardware":
    return Hardware(**{k: values[k] for k in ("world_size", "gpus_per_node", "gpu_memory_gb", "peak_tflops",
                                             "intra_node_gbps", "inter_node_gbps", "efficiency", "overhead_gb",
                                             "fused_attention") if k in values})


def from_preset(name: str) -> tuple[ModelConfig, "Hardware", dict]:
    """(model, cluster, rank_layouts() keywords) of a preset."""
    v = preset_values(name)
    return _model(v), _cluster(v), {"seq_length": v["seq_length"], "global_batch_size": v["global_batch_size"],
                                    "dtype_bytes": 4 if v.get("dtype") == "fp32" else 2}


@dataclass(frozen=True)
class Hardware:
    """The machine. Defaults are an A100-80GB class node: 312 TFLOP/s bf16, NVLink (~300 GB/s of ring bus
    bandwidth per GPU = 2400 Gb/s), one 200 Gb/s InfiniBand port per GPU."""

    world_size: int
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    peak_tflops: float = 312.0
    intra_node_gbps: float = 2400.0  # gigabits per second per GPU, as links are quoted
    inter_node_gbps: float = 200.0
    efficiency: float = 0.5  # achievable fraction of peak for the model's GEMMs (Megatron reaches ~0.4-0.55)
    overhead_gb: float = 2.0  # CUDA context, NCCL buffers, fragmentation: GiB on top of theory's parts
    # A fused attention kernel (flash / memory-efficient SDPA: what this stack runs on CUDA) keeps no s x s
    # probabilities. CodeGeeX's 2022 MindSpore stack on Ascend had none: its preset sets False.
    fused_attention: bool = True


@dataclass
class LayoutEstimate:
    """One layout and its estimate. Bytes are per rank per optimizer step, the largest over stages."""

    plan: ParallelPlan  # the layout, with its sequence parallelism and recompute choice
    parameters: int  # per rank, on the largest stage
    memory_gb: float  # GiB per GPU, worst stage, overhead included
    memory_parts: dict[str, int]  # bytes, worst stage (theory's parts)
    fits: bool
    comm_bytes: dict[str, int]  # tp, cp, pp, dp (ZeRO's group: DP x CP under CP), embedding
    bubble_fraction: float
    time_parts: dict[str, float] = field(default_factory=dict)  # seconds: compute, imbalance, bubble, tp, ...
    rank: int = 0  # 1-based position among the layouts that fit (0: does not fit)

    @property
    def sequence_parallel(self) -> bool:
        return self.plan.sp

    @property
    def recompute(self) -> Recompute:
        return self.plan.recompute

    @property
    def checkpoint_activations(self) -> bool:
        return self.recompute.is_full

    @property
    def recompute_name(self) -> str:
        return self.recompute.granularity or "none"

    @property
    def options(self) -> tuple[bool, str]:
        """(sequence parallel, recompute granularity): with the layout, what tells two rows apart."""
        return self.sequence_parallel, self.recompute_name

    @property
    def step_time(self) -> float:
        return sum(self.time_parts.values())

    @property
    def num_chunks(self) -> int:
        """v, the model chunks per pipeline rank (1: plain 1F1B)."""
        return self.plan.num_chunks

    @property
    def cp_size(self) -> int:
        return self.plan.dims.cp_size

    @property
    def layers_per_virtual_stage(self) -> int | None:
        """``--num-layers-per-virtual-pipeline-stage``: None without interleaving."""
        return len(self.plan.chunk_layers[0][0]) if self.num_chunks > 1 else None

    @property
    def layer_counts(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.plan.stage_layers)

    @property
    def split(self) -> str:
        """Layers per stage, run-length: '10x3+9' = three stages of 10 then one of 9."""
        runs: list[list[int]] = []
        for n in self.layer_counts:
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        return "+".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)

    @property
    def flags(self) -> list[str]:
        """The training flags for CP, interleaving, SP and recompute (the layer split: ``split_flags``)."""
        flags = ["--context-parallel-size", str(self.cp_size)] if self.cp_size > 1 else []
        if self.num_chunks > 1:
            flags += ["--num-layers-per-virtual-pipeline-stage", str(self.layers_per_virtual_stage)]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.recompute.granularity:
            flags += ["--recompute-granularity", self.recompute.granularity]
        return flags

    @property
    def split_flags(self) -> list[str]:
        """The training flags that give this split (layout/stages.py): none when even."""
        c = self.layer_counts
        if len(set(c)) == 1:
            return []
        middle = c[1] if len(c) > 2 else None
        flags = []
        if c[0] != middle:
            flags += ["--decoder-first-pipeline-num-layers", str(c[0])]
        if c[-1] != middle:
            flags += ["--decoder-last-pipeline-num-layers", str(c[-1])]
        return flags


class PlanError(ValueError):
    """Inputs that cannot be planned; the message names the flag."""


def _stage_flops(model: ModelConfig, layers: int, last: bool, b: int, s: int,
                 recompute: Recompute = Recompute()) -> tuple[int, int]:
    """(forward + backward, recompute) FLOPs of one stage for one micro-batch, split like model_flops: full
    recompute re-runs its units' forward, selective ``core_attn`` the attention core's (QK^T and x V)."""
    top_query = last and model.top_query_layer
    per_layer = model_layer_forward_flops(model, b, s)
    top_query_flops = model_layer_forward_flops(model, b, s, top_query=True) if top_query else 0  # multi-head
    logits = 2 * b * s * model.hidden_size * model.padded_vocab_size if last else 0
    if recompute.is_full:
        extra = sum(len(u) for u in recompute.full_units(layers)) * per_layer
        extra += top_query_flops if top_query and recompute.covers_top_query_layer(layers) else 0
    elif recompute.selects("core_attn"):
        extra = (layers + top_query) * 4 * b * s * s * model.hidden_size
    else:
        extra = 0
    return 3 * (layers * per_layer + top_query_flops + logits), extra


@lru_cache(maxsize=None)
def _best_split(model_key: tuple, num_layers: int, pp: int) -> tuple[int, ...]:
    """The split ``stage_layer_counts`` accepts (even, or via first/last flags) whose slowest stage is fastest:
    the last stage also runs the top query layer and the logits, so it often wants fewer layers."""
    model = ModelConfig(**dict(model_key))
    best, best_cost = None, None
    options = [None, *range(1, num_layers + 1)]
    for first in options if pp > 1 else [None]:
        for last in options if pp > 1 else [None]:
            try:
                counts = tuple(stage_layer_counts(num_layers, pp, first, last))
            except LayoutError:
                continue
            cost = max(_stage_flops(model, n, i == pp - 1, 1, 1)[0] for i, n in enumerate(counts))
            if best_cost is None or cost < best_cost:
                best, best_cost = counts, cost
    if best is None:
        raise PlanError(f"--num-layers {num_layers} cannot be split over {pp} stages")
    return best


def _spans_nodes(group_span: int, gpus_per_node: int) -> bool:
    """A block of ``group_span`` consecutive ranks (TP fastest, then DP, then PP: topology.py) lies inside one
    node only if it divides the node size."""
    return group_span > gpus_per_node or gpus_per_node % group_span != 0


def _ring_seconds(counted_bytes: int, group: int, gbps: float) -> float:
    """A ring moves (g - 1) / g of what theory counts per rank: 2N for an all-reduce of N bytes, N for an
    all-gather of N."""
    if group <= 1 or counted_bytes == 0:
        return 0.0
    return counted_bytes * (group - 1) / group / (gbps * 1e9 / 8)


def ring_exposed_seconds(hop: float, block: float, cp: int) -> tuple[float, float]:
    """(forward, backward) seconds of one ring attention over ``cp`` ranks that its blocks do not hide, ``hop`` being
    the seconds of one K/V transfer and ``block`` those of a later step's block forward (the own block, step 0's, is
    twice that; a backward block twice its forward). Forward: step i < n - 1 posts the next hop, then computes.
    Backward: step 0 posts K/V, steps 1 .. n - 2 K/V and the dK/dV sum (two hops), step n - 1 the sum; the sum's
    last hop home follows the last block, exposed."""
    if cp == 1:
        return 0.0, 0.0
    own = 2 * block
    forward = max(0.0, hop - own) + (cp - 2) * max(0.0, hop - block)
    backward = (max(0.0, hop - 2 * own) + (cp - 2) * max(0.0, 2 * hop - 2 * block) + max(0.0, hop - 2 * block)
                + hop)
    return forward, backward


def _ring_attention_seconds(w: Workload, pp_rank: int, flops_per_s: float, gbps: float) -> float:
    """Exposed ring seconds of one micro-batch on stage ``pp_rank``: each attention's forward and backward, and the
    forwards recomputation re-runs (``ring_exposed_seconds``)."""
    if w.cp_size == 1:
        return 0.0
    b, s, h, t = w.plan.micro_batch_size, w.local_seq_length, w.model.hidden_size, w.tp_size
    # K and V of this rank's key-value groups and tokens (the top query layer's, multi-head, taken alike)
    hop = 2 * b * s * w.model.kv_size * w.dtype_bytes / t / (gbps * 1e9 / 8)
    block = 2 * b * s * s * h / t / flops_per_s  # s/n queries x s/(2n) keys: 2 matmuls of 2 FLOPs per MAC
    forward, backward = ring_exposed_seconds(hop, block, w.cp_size)
    attentions = w.layers_on(pp_rank) + w.top_query_on(pp_rank)
    return attentions * (forward + backward) + recomputed_attentions(w, pp_rank) * forward


def _layer_ranges(counts: tuple[int, ...]) -> tuple[range, ...]:
    """Layers per stage -> each stage's global layer numbers, as ``pipeline.stages.stage_layer_ranges``."""
    return tuple(range(end - n, end) for n, end in zip(counts, accumulate(counts)))


def estimate_layout(model: ModelConfig, cluster: Hardware, *, seq_length: int, global_batch_size: int, tp: int,
                    pp: int, micro_batch_size: int, recompute: Recompute = Recompute(),
                    sequence_parallel: bool = False, dtype_bytes: int = 2,
                    stage_layers: tuple[int, ...] | None = None, num_chunks: int = 1, device: str = "cuda",
                    cp: int = 1) -> LayoutEstimate:
    """Memory, traffic and step time of one layout, whose plan training's rules derive (``ParallelPlan.derive``:
    LayoutError for a layout training would refuse). ``stage_layers``: layers per stage; default the split with the
    fastest slowest stage, or with ``num_chunks`` v > 1 (interleaved 1F1B) the even split into p x v chunks.
    ``device``: "cuda" or "cpu" (the accounting's device; a cluster without fused attention overrides it). ``cp``:
    the context-parallel size."""
    counts = stage_layers
    if counts is None and num_chunks == 1:
        counts = _best_split(tuple(sorted(vars(model).items())), model.num_layers, pp)
    plan = ParallelPlan.derive(ParallelDims(cluster.world_size, tp, pp, cp), micro_batch_size=micro_batch_size,
                               global_batch_size=global_batch_size, num_layers=model.num_layers,
                               stage_layers=_layer_ranges(counts) if counts else None, num_chunks=num_chunks,
                               sequence_parallel=sequence_parallel, recompute=recompute, seq_length=seq_length,
                               hidden_size=model.hidden_size, dtype="fp32" if dtype_bytes == 4 else "bf16")
    w = Workload(model, plan, device=device if cluster.fused_attention else "unfused")
    dp, m, counts = plan.dims.dp_size, plan.num_microbatches, tuple(len(r) for r in plan.stage_layers)
    stages = range(pp)
    mems = [memory_per_rank(w, i) for i in stages]
    comms = [comm_bytes_per_step(w, i) for i in stages]
    worst = max(stages, key=lambda i: mems[i].total)
    memory_gb = mems[worst].total / GIB + cluster.overhead_gb

    # Per micro-batch and stage: compute, then the blocking TP all-reduces and PP sends, the ring's exposed hops.
    flops_per_s = cluster.peak_tflops * 1e12 * cluster.efficiency
    pipeline_inter = _spans_nodes(cluster.world_size, cluster.gpus_per_node)  # PP is the outermost dimension
    dp_inter = _spans_nodes(tp * cp * dp, cluster.gpus_per_node)  # ZeRO's group: DP x CP
    cp_gbps = cluster.inter_node_gbps if _spans_nodes(tp * cp, cluster.gpus_per_node) else cluster.intra_node_gbps
    flops = [_stage_flops(model, n, i == pp - 1, micro_batch_size, seq_length, recompute)
             for i, n in enumerate(counts)]
    compute = [sum(f) / (tp * cp) / flops_per_s for f in flops]
    tp_s = [_ring_seconds(c["tp"] // m, tp, cluster.intra_node_gbps) for c in comms]  # TP <= one node
    cp_s = [_ring_attention_seconds(w, i, flops_per_s, cp_gbps) for i in stages]
    pp_s = [c["pp"] / m / ((cluster.inter_node_gbps if pipeline_inter else cluster.intra_node_gbps) * 1e9 / 8)
            for c in comms]
    per_mb = [compute[i] + tp_s[i] + cp_s[i] + pp_s[i] for i in stages]
    slow = max(stages, key=lambda i: per_mb[i])
    mean_compute = sum(compute) / pp

    # After the flush: ZeRO-2's DP (x CP) traffic and the tied-embedding all-reduce, on the worst stage.
    zero = dp * cp  # the group ZeRO reduces over

    def after_flush(i: int) -> tuple[float, float]:
        dp_gbps = cluster.inter_node_gbps if dp_inter else cluster.intra_node_gbps
        gather = dp_allgather_bytes(w, i)
        reduce = _ring_seconds(comms[i][w.dp_group] - gather, zero, dp_gbps)
        bucket = _ring_seconds(min(w.reduce_bucket_size, stage_parameters(w, i)) * dtype_bytes * 2, zero, dp_gbps)
        backward = m * compute[i] * (2 * flops[i][0] / 3) / sum(flops[i])  # the backward's share
        exposed_dp = max(reduce - backward, min(bucket, reduce)) + _ring_seconds(gather, zero, dp_gbps)
        emb = _ring_seconds(comms[i]["embedding"], 2,
                            cluster.inter_node_gbps if pipeline_inter else cluster.intra_node_gbps)
        return exposed_dp, emb

    flush = [after_flush(i) for i in stages]
    last = max(stages, key=lambda i: sum(flush[i]))
    parts = {
        "compute": m * mean_compute,
        "imbalance": m * (compute[slow] - mean_compute),
        "bubble": (pp - 1) * per_mb[slow] / num_chunks,  # interleaved: p - 1 slots of one chunk, 1/v of a stage
        "tp": m * tp_s[slow],
        "cp": m * cp_s[slow],
        "pp": m * pp_s[slow],
        "dp": flush[last][0],
        "embedding": flush[last][1],
    }
    # by group, ZeRO's under "dp" (DP x CP's under CP), "cp" 0 at CP 1
    bytes_ = {g: max(c.get(g, 0) for c in comms) for g in ("tp", "cp", "pp", "embedding")}
    bytes_["dp"] = max(c[w.dp_group] for c in comms)
    return LayoutEstimate(plan=plan, parameters=max(stage_parameters(w, i) for i in stages), memory_gb=memory_gb,
               memory_parts=mems[worst].as_dict(), fits=memory_gb <= cluster.gpu_memory_gb,
               comm_bytes=bytes_, bubble_fraction=(pp - 1) / (num_chunks * m), time_parts=parts)


def _derived(dims: ParallelDims, **kw) -> ParallelPlan | None:
    """The plan training derives for this layout, or None where it refuses it."""
    try:
        return ParallelPlan.derive(dims, **kw)
    except LayoutError:
        return None


def chunk_counts(num_layers: int, pp: int, num_microbatches: int) -> list[int]:
    """The v (model chunks per rank) training accepts for a layout: 1, and where Megatron's rules allow interleaving
    (PP > 1, m divisible by PP) every v > 1 that splits the layers evenly into p x v chunks."""
    dims, counts = ParallelDims(pp, pp_size=pp), [1]
    for n in range(num_layers // (2 * pp), 0, -1):  # n layers per virtual stage: v = layers / (p n) >= 2
        plan = _derived(dims, micro_batch_size=1, num_microbatches=num_microbatches, num_layers=num_layers,
                        num_layers_per_virtual_pipeline_stage=n)
        if plan is not None:
            counts.append(plan.num_chunks)
    return counts


def _splits_sequence(seq_length: int, cp: int) -> bool:
    """Whether CP ``cp`` cuts ``seq_length`` the way training does (``ParallelPlan.derive``)."""
    try:
        context_parallel_chunk_length(seq_length, cp)
    except LayoutError:
        return False
    return True


def context_parallel_sizes(seq_length: int, world_size: int) -> list[int]:
    """The CP sizes the planner lists: 1, and each power of two n dividing the GPUs whose 2n chunks split the
    sequence (training's rule) with at least ``MIN_CP_TOKENS`` tokens per rank."""
    sizes, n = [1], 2
    while seq_length // n >= MIN_CP_TOKENS and world_size % n == 0:
        if _splits_sequence(seq_length, n):
            sizes.append(n)
        n *= 2
    return sizes


def _splits_model(model: ModelConfig, tp: int) -> bool:
    """Whether TP ``tp`` divides the heads, the MLP and the padded vocabulary (the shards), as training checks it."""
    try:
        model.validate(tp)
    except ModelConfigError:
        return False
    return True


def candidate_layouts(model: ModelConfig, cluster: Hardware, seq_length: int, global_batch_size: int,
                      micro_batch_sizes: list[int] | None = None, cp_sizes: list[int] | None = None):
    """(tp, cp, pp, micro, v) that training would accept: TP divides the heads, the MLP and the padded vocabulary
    (the shards) and the node (TP stays on NVLink); CP from ``cp_sizes`` (default ``context_parallel_sizes``); PP <=
    layers; the rest as ``ParallelPlan.derive`` checks it (DP = world / (TP x CP x PP) whole, a whole number of
    micro-batches per DP rank, the sequence split); v from ``chunk_counts``. Micro-batches: ``micro_batch_sizes``,
    default every power of two that training accepts."""
    world = cluster.world_size
    for tp in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % tp or not _splits_model(model, tp):
            continue
        for cp in cp_sizes or context_parallel_sizes(seq_length, world):
            for pp in range(1, min(model.num_layers, world // (tp * cp)) + 1):
                try:
                    dims = ParallelDims(world, tp, pp, cp)
                except LayoutError:
                    continue
                for b in micro_batch_sizes or [1 << k for k in range(global_batch_size.bit_length())]:
                    plan = _derived(dims, micro_batch_size=b, global_batch_size=global_batch_size,
                                    seq_length=seq_length)
                    if plan is not None:
                        for v in chunk_counts(model.num_layers, pp, plan.num_microbatches):
                            yield tp, cp, pp, b, v


RECOMPUTES = (Recompute(), Recompute("selective"), Recompute.full())  # none, selective (core_attn), full


def rank_layouts(model: ModelConfig, cluster: Hardware, *, seq_length: int, global_batch_size: int,
                 micro_batch_sizes: list[int] | None = None, dtype_bytes: int = 2,
                 recomputes: tuple[Recompute, ...] = RECOMPUTES,
                 sequence_parallel: tuple[bool, ...] = (False, True), cp_sizes: list[int] | None = None) -> list[LayoutEstimate]:
    """Every valid layout (interleaved or not, with each CP size of ``cp_sizes``, default
    ``context_parallel_sizes``) with each recompute choice, and with and without sequence parallelism where TP > 1
    divides a rank's tokens: fitting ones first ranked by estimated step time (``rank`` 1, 2, ...), then the ones
    that do not fit, by memory."""
    model.validate()
    model.check_sequence_length(seq_length)
    rows = []
    for tp, cp, pp, b, v in candidate_layouts(model, cluster, seq_length, global_batch_size, micro_batch_sizes,
                                              cp_sizes):
        for sp in sequence_parallel:
            if sp and tp == 1:
                continue  # SP does nothing at TP 1: the row without it
            for rc in recomputes:
                try:
                    rows.append(estimate_layout(model, cluster, seq_length=seq_length,
                                                global_batch_size=global_batch_size, tp=tp, pp=pp, micro_batch_size=b,
                                                recompute=rc, sequence_parallel=sp, dtype_bytes=dtype_bytes,
                                                num_chunks=v, cp=cp))
                except LayoutError:  # SP where TP does not divide a rank's tokens: training refuses it
                    if not sp:
                        raise
                    break
    fit = sorted((r for r in rows if r.fits), key=lambda r: r.step_time)
    for i, r in enumerate(fit, 1):
        r.rank = i
    return fit + sorted((r for r in rows if not r.fits), key=lambda r: r.memory_gb)


# ---------------------------------------------------------------------------------------------------- CLI

COLUMNS = ("#", "TP", "PP", "v", "DP", "micro", "m", "SP", "recompute", "CP", "layers", "mem GiB", "TP GB", "CP GB",
           "PP GB", "DP GB", "emb GB", "bubble", "step s", "compute", "imbal", "bubble s", "tp s", "cp s", "pp s",
           "dp s", "emb s")


def format_table(rows: list[LayoutEstimate]) -> str:
    def cells(r: LayoutEstimate) -> list[str]:
        gb = {g: f"{v / 1e9:.2f}" for g, v in r.comm_bytes.items()}
        t, layout, dims = r.time_parts, r.plan, r.plan.dims
        return [str(r.rank or "-"), str(dims.tp_size), str(dims.pp_size), str(r.num_chunks), str(dims.dp_size),
                str(layout.micro_batch_size), str(layout.num_microbatches),
                "yes" if r.sequence_parallel else "no", r.recompute_name, str(r.cp_size), r.split,
                f"{r.memory_gb:.1f}", gb["tp"], gb["cp"], gb["pp"], gb["dp"], gb["embedding"],
                f"{r.bubble_fraction:.2f}", f"{r.step_time:.2f}",
                *(f"{t[k]:.2f}" for k in ("compute", "imbalance", "bubble", "tp", "cp", "pp", "dp", "embedding"))]

    table = [list(COLUMNS)] + [cells(r) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, naming the flag; no usage dump, no traceback
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m codegeex_train.accounting.planner",
                description="Rank (TP, CP, PP, v, DP, micro-batch, sequence parallelism, recompute) layouts by "
                            "estimated step time.")
    p.add_argument("--config", metavar="NAME", help="a preset, configs/NAME.yaml (codegeex-13b: CodeGeeX's model "
                   "and cluster), or a .yaml file: its model, batch and planner: sections; flags given override it")
    pint, pfloat = _positive(int), _positive(float)
    m = p.add_argument_group("model (the training CLI's flags)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--vocab-size",
                 "--max-position-embeddings", "--seq-length", "--global-batch-size"):
        m.add_argument(flag, type=pint)
    m.add_argument("--make-vocab-size-divisible-by", type=pint, help="(default 128)")
    m.add_argument("--no-top-query-layer", action="store_true", default=None,
                   help="a plain GPT (no CodeGeeX top query layer)")
    m.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   help="rope: no position table, a one-row top query table (default learned_absolute)")
    m.add_argument("--normalization", choices=NORMALIZATIONS, help="RMSNorm: a weight and no bias per norm, one "
                   "fp32 statistic per token (default LayerNorm)")
    m.add_argument("--swiglu", action="store_true", default=None, help="gated MLP: h -> 2 ffn ([gate; up]), ffn -> h")
    m.add_argument("--group-query-attention", action="store_true", default=None,
                   help="grouped-query attention (with --num-query-groups): keys and values of g d channels; TP "
                        "must divide g")
    m.add_argument("--num-query-groups", type=pint, help="the key-value groups g")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="an output layer of its own on the last stage: no embedding all-reduce")
    m.add_argument("--disable-bias-linear", action="store_true", default=None,
                   help="no biases in the attention's and MLP's linear layers")
    m.add_argument("--add-qkv-bias", action="store_true", default=None,
                   help="with --disable-bias-linear: keep the QKV bias (Qwen2's)")
    m.add_argument("--micro-batch-size", type=pint, nargs="+", help="candidates (default: powers of two)")
    m.add_argument("--tensor-model-parallel-size", type=pint, help="show only this TP (ranks stay global)")
    m.add_argument("--pipeline-model-parallel-size", type=pint, help="show only this PP")
    m.add_argument("--context-parallel-size", type=pint,
                   help=f"show only this CP (default: 1 and the powers of two that leave each rank at least "
                        f"{MIN_CP_TOKENS} tokens of a sequence)")
    m.add_argument("--num-layers-per-virtual-pipeline-stage", type=pint,
                   help="show only interleaved 1F1B layouts with this many layers per model chunk (the column v "
                        "is the chunks per rank: layers / (PP x this))")
    m.add_argument("--sequence-parallel", choices=("yes", "no"), help="show only layouts with / without SP")
    m.add_argument("--recompute-granularity", choices=("none", "selective", "full"),
                   help="show only this recompute choice (selective: core_attn)")
    prec = m.add_mutually_exclusive_group()
    for name in ("bf16", "fp16", "fp32"):
        prec.add_argument(f"--{name}", dest="dtype", action="store_const", const=name)
    c = p.add_argument_group("cluster (defaults: A100-80GB class; see Hardware)")
    c.add_argument("--world-size", type=pint)
    c.add_argument("--gpus-per-node", type=pint)
    c.add_argument("--gpu-memory-gb", type=pfloat)
    c.add_argument("--peak-tflops", type=pfloat, help="dense peak of the compute dtype per GPU")
    c.add_argument("--intra-node-gbps", type=pfloat, help="per-GPU link inside a node, Gb/s (bits)")
    c.add_argument("--inter-node-gbps", type=pfloat, help="per-GPU link between nodes, Gb/s (bits)")
    c.add_argument("--efficiency", type=pfloat, help="achievable fraction of peak (default 0.5)")
    c.add_argument("--overhead-gb", type=float, help="GiB per GPU beyond theory's parts (default 2)")
    c.add_argument("--unfused-attention", dest="fused_attention", action="store_const", const=False,
                   help="the devices have no fused (flash) attention: attention keeps its s x s probabilities "
                        "(set by --config codegeex-13b: MindSpore on Ascend)")
    p.add_argument("--top", type=pint, default=10, help="rows to print (default 10)")
    p.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    try:
        values = {**(preset_values(args.config) if args.config else {}), **given}
    except ConfigFileError as e:
        p.error(str(e))
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                 "global_batch_size", "world_size"):
        if flag not in values:
            p.error(f"--{flag.replace('_', '-')} is required (or --config)")
    if values.get("efficiency", 0.5) > 1:
        p.error(f"--efficiency {values['efficiency']}: a fraction of peak, at most 1")
    try:
        model = _model(values)
    except ModelConfigError as e:
        p.error(str(e))
    cluster = _cluster(values)
    dtype = values.get("dtype", "bf16")
    only_tp, only_pp = values.get("tensor_model_parallel_size"), values.get("pipeline_model_parallel_size")
    if only_tp is not None:
        try:  # a TP the shapes refuse (heads, KV groups, MLP, vocabulary): training's own one line
            model.validate(only_tp)
        except ModelConfigError as e:
            p.error(str(e))
    only_cp, seq = values.get("context_parallel_size"), values["seq_length"]
    if only_cp is not None and only_cp > 1:
        try:
            context_parallel_chunk_length(seq, only_cp)
        except LayoutError as e:
            p.error(str(e))
    cp_sizes = None if only_cp is None else sorted({*context_parallel_sizes(seq, cluster.world_size), only_cp})
    try:
        rows = rank_layouts(model, cluster, seq_length=seq, global_batch_size=values["global_batch_size"],
                            micro_batch_sizes=values.get("micro_batch_size"), dtype_bytes=4 if dtype == "fp32" else 2,
                            cp_sizes=cp_sizes)
    except (ModelConfigError, PlanError) as e:
        p.error(str(e))
    if not rows:
        p.error(f"no layout: --world-size {cluster.world_size} and --global-batch-size "
                f"{values['global_batch_size']} admit no TP x CP x PP x DP with a whole number of micro-batches")
    only_sp, only_rc = values.get("sequence_parallel"), values.get("recompute_granularity")
    only_vpp = values.get("num_layers_per_virtual_pipeline_stage")
    shown = [r for r in rows if (args.all or r.fits) and only_tp in (None, r.plan.dims.tp_size)
             and only_pp in (None, r.plan.dims.pp_size) and only_vpp in (None, r.layers_per_virtual_stage)
             and only_cp in (None, r.cp_size)
             and only_sp in (None, "yes" if r.sequence_parallel else "no")
             and only_rc in (None, r.recompute_name)][:args.top]
    fitting = sum(r.fits for r in rows)
    print(f"{describe_model(model)}, seq {values['seq_length']}, global batch {values['global_batch_size']}, {dtype}; "
          f"{cluster.world_size} GPUs, {cluster.gpus_per_node}/node, {cluster.gpu_memory_gb:g} GiB, "
          f"{cluster.peak_tflops:g} TFLOP/s x {cluster.efficiency:g}, links {cluster.intra_node_gbps:g} / "
          f"{cluster.inter_node_gbps:g} Gb/s intra / inter, {cluster.overhead_gb:g} GiB overhead")
    print(f"{fitting} of {len(rows)} layouts fit; bytes per rank per step (GB), times in seconds per step")
    if not fitting and not args.all:
        smallest, layout = rows[0], rows[0].plan
        print(f"nothing fits: the smallest needs {smallest.memory_gb:.1f} GiB (TP {layout.dims.tp_size} CP "
              f"{layout.dims.cp_size} PP {layout.dims.pp_size} micro {layout.micro_batch_size} SP "
              f"{'yes' if smallest.sequence_parallel else 'no'} recompute {smallest.recompute_name}); see --all")
        return
    print(format_table(shown))
    interleaved = sorted({(r.plan.dims.pp_size, r.num_chunks, r.layers_per_virtual_stage)
                          for r in shown if r.num_chunks > 1})
    if interleaved:
        print("v > 1: interleaved 1F1B, trained with --num-layers-per-virtual-pipeline-stage N = layers / (PP x v): "
              + ", ".join(f"PP {p} v {v}: N {n}" for p, v, n in interleaved))


if __name__ == "__main__":
    main()
