"""What a layout should cost per rank, from the shapes alone: bytes moved per optimizer step by group, and
memory by part. The same formulas serve the start-up report, the metrics (theory beside measurement) and
the layout planner (``python -m codegeex_train.accounting.planner``), so a wrong formula shows up as a measured
mismatch.

Notation (seed 000): b micro-batch, s sequence, h hidden, a heads, V padded vocabulary, t/p/d the TP/PP/DP
sizes, m micro-batches per step, e bytes per element of the compute dtype, phi = b*s*h*e.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from codegeex_train.config.model import ModelConfig
from codegeex_train.distributed.layout import Layout


@dataclass(frozen=True)
class Workload:
    """A model, a batch and a layout, as the formulas need them. The layout (sizes, micro-batches, the layers of
    each stage) is the run's ``Layout``; an empty ``stage_layers`` means an even split."""

    model: ModelConfig
    seq_length: int
    layout: Layout
    dtype_bytes: int = 4  # compute / weight dtype: 4 fp32, 2 bf16 or fp16
    checkpoint_activations: bool = False
    zero_stage: int = 2
    reduce_bucket_size: int = 500_000_000  # DeepSpeed's defaults, in elements
    allgather_bucket_size: int = 500_000_000
    device: str = "cuda"  # where SDPA runs: decides whether attention keeps its s x s probabilities

    @classmethod
    def from_run(cls, args, layout: Layout, ds_config: dict | None = None, device: str = "cpu") -> "Workload":
        """The workload of a training run (parsed ``Args``, its ``Layout``, DeepSpeed config, device type)."""
        t, zero = args.train, (ds_config or {}).get("zero_optimization", {})
        return cls(args.model, t.seq_length, layout, dtype_bytes=2 if (t.bf16 or t.fp16) else 4,
                   checkpoint_activations=t.checkpoint_activations, zero_stage=t.zero_stage,
                   reduce_bucket_size=int(zero.get("reduce_bucket_size", cls.reduce_bucket_size)),
                   allgather_bucket_size=int(zero.get("allgather_bucket_size", cls.allgather_bucket_size)),
                   device=device)

    def __post_init__(self) -> None:
        num_layers, pp = self.model.num_layers, self.layout.dims.pp_size
        given = ranges = self.layout.stage_layers
        if not ranges and num_layers % pp == 0:  # even split by default
            n = num_layers // pp
            ranges = tuple(range(i * n, (i + 1) * n) for i in range(pp))
        if len(ranges) != pp or [i for r in ranges for i in r] != list(range(num_layers)):
            raise ValueError(f"{num_layers} layers do not split into {pp} pipeline stages as "
                             f"{list(given) or 'evenly'}: give the Layout's stage_layers, one range per stage, "
                             f"covering every layer once")
        # frozen: set once, here, so that the formulas read the split from the layout alone
        object.__setattr__(self, "layout", replace(self.layout, stage_layers=tuple(ranges)))

    # The sizes as Topology names them: the formulas' t, p, d.
    tp_size = property(lambda self: self.layout.dims.tp_size)
    pp_size = property(lambda self: self.layout.dims.pp_size)
    dp_size = property(lambda self: self.layout.dims.dp_size)

    def layers_on(self, pp_rank: int) -> int:
        return len(self.layout.stage_layers[pp_rank])

    def first(self, pp_rank: int) -> bool:
        return pp_rank == 0

    def last(self, pp_rank: int) -> bool:
        return pp_rank == self.pp_size - 1


# --------------------------------------------------------------------------------------------- parameters

def layer_parameters(model: ModelConfig, tp: int) -> int:
    """One transformer layer's parameters on one TP rank (the top query layer has the same shapes)."""
    h, ffn = model.hidden_size, model.ffn_hidden_size
    replicated = 2 * 2 * h + h + h  # two LayerNorms, the row-parallel biases (attention dense, MLP out)
    split = (3 * h * h + 3 * h) + h * h + (h * ffn + ffn) + ffn * h  # QKV, dense, h->ffn, ffn->h
    return replicated + split // tp


def stage_parameters(w: Workload, pp_rank: int) -> int:
    """Parameters held by one rank of stage ``pp_rank`` (both tied copies of the word table count: each end
    holds, trains and stores its own)."""
    m, h = w.model, w.model.hidden_size
    n = w.layers_on(pp_rank) * layer_parameters(m, w.tp_size)
    if w.first(pp_rank):
        n += m.padded_vocab_size // w.tp_size * h + m.max_position_embeddings * h
    if w.last(pp_rank):
        n += 2 * h  # final LayerNorm
        if m.top_query_layer:
            n += m.max_position_embeddings * h + layer_parameters(m, w.tp_size)
        if not w.first(pp_rank):
            n += m.padded_vocab_size // w.tp_size * h  # the output layer's copy of the word table
    return n


def largest_parameter(w: Workload, pp_rank: int) -> int:
    """Elements of the largest single parameter on one rank of stage ``pp_rank``."""
    m, h, t = w.model, w.model.hidden_size, w.tp_size
    sizes = [3 * h * h // t, h * m.ffn_hidden_size // t] if w.layers_on(pp_rank) or w.last(pp_rank) else [0]
    if w.first(pp_rank) or w.last(pp_rank):
        sizes.append(m.padded_vocab_size // t * h)
    if w.first(pp_rank) or (w.last(pp_rank) and m.top_query_layer):
        sizes.append(m.max_position_embeddings * h)
    return max(sizes)


# ------------------------------------------------------------------------------------------ communication

GROUPS = ("tp", "pp", "dp", "embedding")


def comm_bytes_per_step(w: Workload, pp_rank: int = 0) -> dict[str, int]:
    """Bytes one rank of stage ``pp_rank`` moves per optimizer step, by group, counted as in
    ``accounting.counter`` (an all-reduce of N bytes moves 2N; p2p counts what this rank sends)."""
    m = w.model
    b, s, h, e = w.layout.micro_batch_size, w.seq_length, m.hidden_size, w.dtype_bytes
    phi = b * s * h * e
    out = dict.fromkeys(GROUPS, 0)
    if w.tp_size > 1:
        attentions = w.layers_on(pp_rank) + (1 if w.last(pp_rank) and m.top_query_layer else 0)
        # Per layer: attention and MLP each one all-reduce of phi forward (g) and one backward (f): 2 x 4 phi.
        # Recompute repeats the two forward ones.
        per_layer = 8 * phi + (4 * phi if w.checkpoint_activations else 0)
        tp = attentions * per_layer
        if w.last(pp_rank) and m.top_query_layer:
            tp += 2 * phi  # the top query layer's queries enter the TP region through their own f (backward)
        if w.first(pp_rank):
            tp += 2 * phi  # vocab-parallel embedding: masked lookup, then all-reduce (forward only)
        if w.last(pp_rank):
            tp += 2 * phi  # output layer's f: its input gradient is all-reduced (backward only)
            tp += 2 * (b * s * 4) + 2 * (2 * b * s * 4)  # loss, fp32: row max, then (sum of exp, target logit)
        out["tp"] = w.layout.num_microbatches * tp
    if w.pp_size > 1:
        sends = (0 if w.last(pp_rank) else 1) + (0 if w.first(pp_rank) else 1)  # activations down, grads up
        out["pp"] = w.layout.num_microbatches * sends * phi
    grad_bytes = 4 if w.dtype_bytes == 4 else w.dtype_bytes  # ZeRO reduces gradients in the param dtype
    tied = m.padded_vocab_size // w.tp_size * h * 4  # fp32 full gradient of the word table
    if w.pp_size > 1 and (w.first(pp_rank) or w.last(pp_rank)):
        out["embedding"] = 2 * tied  # the two copies' gradients summed (pipeline/shared_embedding.py)
    if w.dp_size > 1:
        params = stage_parameters(w, pp_rank)
        # ZeRO-2 all-reduces every micro-batch's gradients bucket by bucket (DeepSpeed's reduce_scatter is a
        # bucket all-reduce plus slicing), then all-gathers the updated weights after the step.
        dp = w.layout.num_microbatches * 2 * params * grad_bytes + dp_allgather_bytes(w, pp_rank)
        if w.pp_size > 1 and (w.first(pp_rank) or w.last(pp_rank)):
            dp += 2 * tied  # safe_get_full_grad of the tied copy: one all-reduce over DP
        out["dp"] = dp
    return out


def dp_allgather_bytes(w: Workload, pp_rank: int) -> int:
    """ZeRO-2's all-gather of the updated weights after the step, per rank of stage ``pp_rank`` (part of "dp")."""
    return stage_parameters(w, pp_rank) * w.dtype_bytes if w.dp_size > 1 else 0


# ------------------------------------------------------------------------------------------------- memory

def fused_attention(w: Workload) -> bool:
    """Whether SDPA runs a fused kernel that keeps no s x s probabilities: always on CUDA (flash or
    memory-efficient, dropout included); on CPU only without attention dropout (else torch's math path)."""
    return w.device == "cuda" or w.model.attention_dropout == 0.0


def activation_bytes_per_microbatch(w: Workload, pp_rank: int = 0) -> int:
    """Bytes autograd keeps for one micro-batch's backward on one rank (Korthikanti et al. 2022, with the
    element size a parameter): per layer (4e + 2) sbh replicated (two LayerNorm inputs, the two column-parallel
    inputs, two one-byte dropout masks) + (4e + 2e ffn/h) sbh / t (Q, K, V, the attention output; the MLP's
    activation input and output), plus the attention itself: with a fused kernel its output (e sbh / t) and
    fp32 log-sum-exp (4 a s b / t); on torch's math path the s x s probabilities, the dropout mask in the compute
    dtype and the dropped probabilities (3e a s^2 b / t). With recompute a layer keeps only its input (e sbh)
    until its backward rebuilds the rest."""
    m = w.model
    b, s, h, a = w.layout.micro_batch_size, w.seq_length, m.hidden_size, m.num_attention_heads
    e, t = w.dtype_bytes, w.tp_size
    sbh = s * b * h
    sharded = (4 * e * h + 2 * e * m.ffn_hidden_size) * s * b  # Q, K, V, dense input; activation in and out
    if fused_attention(w):
        attention = e * sbh // t + 4 * a * s * b // t
    else:
        attention = 3 * e * a * s * s * b // t
    per_layer = (4 * e + 2) * sbh + sharded // t + attention
    layers = w.layers_on(pp_rank) + (1 if w.last(pp_rank) and m.top_query_layer else 0)
    if w.checkpoint_activations:
        total = layers * e * sbh + per_layer  # inputs kept, one layer rebuilt at a time
    else:
        total = layers * per_layer
    if w.first(pp_rank):
        total += sbh  # embedding dropout mask
    if w.last(pp_rank):
        total += e * sbh + b * s * m.padded_vocab_size // t * 4  # final LayerNorm input; fp32 softmax for the loss
    return total


def microbatches_in_flight(w: Workload, pp_rank: int) -> int:
    """1F1B: stage i holds the activations of at most p - i micro-batches at once."""
    return min(w.pp_size - pp_rank, w.layout.num_microbatches)


@dataclass
class MemoryParts:
    """Bytes per rank by part; ``total`` is their sum."""

    weights: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int
    notes: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "buffers": self.buffers, "activations": self.activations, "total": self.total}


def memory_per_rank(w: Workload, pp_rank: int = 0) -> MemoryParts:
    """ZeRO-2 under DeepSpeed: weights whole in the compute dtype; an fp32 master copy, Adam's two moments and
    the gradient, each partitioned over DP (1/d); the gradient bucket of reduce_bucket_size elements (the
    largest parameter when bigger; at most the stage's parameters) and, with DP > 1, the all-gather staging."""
    psi = stage_parameters(w, pp_rank)
    e, d = w.dtype_bytes, w.dp_size
    if w.zero_stage == 0:
        shard = psi
    else:
        shard = -(-psi // d)  # ceil: the last partition is padded
    master = 4 * shard if (e != 4 or w.zero_stage > 0) else 0  # ZeRO keeps an fp32 partition even in fp32
    optimizer = master + 8 * shard
    # ZeRO-2 keeps the whole gradient of each parameter overlapping this rank's partition (DeepSpeed 0.19,
    # measured): at least the largest one, which for small models (the word table) exceeds Psi/d.
    gradients = 4 * max(shard, largest_parameter(w, pp_rank) if d > 1 else 0) if w.zero_stage >= 2 else 4 * psi
    bucket = min(w.reduce_bucket_size, psi) * e
    activations = activation_bytes_per_microbatch(w, pp_rank) * microbatches_in_flight(w, pp_rank)
    return MemoryParts(weights=psi * e, gradients=gradients, optimizer=optimizer, buffers=bucket,
                       activations=activations, notes={"parameters": psi, "partition": shard})


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def expected_memory_report(w: Workload) -> str:
    """The start-up lines: predicted memory and bytes moved per step, per rank of each stage."""
    lines = [f"expected per rank (ZeRO-{w.zero_stage}, DP {w.dp_size}, {w.dtype_bytes}-byte weights; measured at the "
             f"2nd step as the metrics' 'memory' record):"]
    for pp_rank in range(w.pp_size):
        parts = memory_per_rank(w, pp_rank)
        comm = comm_bytes_per_step(w, pp_rank)
        stage = f"  stage {pp_rank}: " if w.pp_size > 1 else "  "
        lines.append(f"{stage}weights {_gib(parts.weights)}, gradients {_gib(parts.gradients)}, optimizer "
                     f"{_gib(parts.optimizer)}, buffers {_gib(parts.buffers)}, activations {_gib(parts.activations)}"
                     f" ({microbatches_in_flight(w, pp_rank)} micro-batch(es) in flight): total {_gib(parts.total)}; "
                     f"per step moves " + ", ".join(f"{g} {_gib(n)}" for g, n in comm.items() if n))
    return "\n".join(lines)
