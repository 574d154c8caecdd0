"""What a layout should cost per rank, from the shapes alone: bytes moved per optimizer step by group, and
memory by part. The same formulas serve the start-up report, the metrics (theory beside measurement) and
the layout planner (``python -m codegeex_train.accounting.planner``), so a wrong formula shows up as a measured
mismatch.

Notation (seed 000): b micro-batch, s sequence, h hidden, a heads, f MLP width (4h), V padded vocabulary, t/p/d the
TP/PP/DP sizes, m micro-batches per step, e bytes per element of the compute dtype, phi = b*s*h*e; r = t under
sequence parallelism (the LayerNorms, dropouts and residual adds hold s/t of the sequence), else 1; v model chunks
per pipeline rank (interleaved 1F1B; 1 without it), chunk c of rank i being virtual stage c*p + i.

The architecture options (ModelConfig; docs/model-families.md) enter through the shapes: grouped-query attention's g
key-value groups (kv = g d channels of K and of V instead of h: the [Q; K; V] weight, the activations K and V, the
ring's hops), SwiGLU's [gate; up] (2f rows of the first MLP matrix, its 2f-wide output kept), RMSNorm (a weight and
one fp32 statistic per token instead of LayerNorm's two of each), --disable-bias-linear / --add-qkv-bias (which biases
exist), the untied output layer (its own V/t x h table on the last stage; no embedding-group all-reduce, and none of
ZeRO's for a tied copy) and the sliding window (a masked attention: see ``attention_core_bytes``). The TP collectives
are the same in number and size whatever the options: an f/g pair per attention and per MLP.

Context parallelism (CP size n, ``--context-parallel-size``): a rank holds s/n tokens of every sequence (two of 2n
chunks, context_parallel/chunks.py) and its layers see only those, so every formula below reads s as the rank's
local length s/n (``Workload.local_seq_length``), phi included; attention becomes the K/V ring
(context_parallel/ring_attention.py: its bytes in the group "cp", no s x s kept); ZeRO reduces and partitions over
DP x CP (d n ranks, the group "dp_cp"). CP 1 is exactly the formulas without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.recompute import Recompute
from codegeex_train.context_parallel import ring_attention_bytes
from codegeex_train.pipeline.schedules import interleaved_one_f_one_b
from codegeex_train.layout.stages import covers_each_layer_once


@dataclass(frozen=True)
class Workload:
    """A model and the run's ``ParallelPlan`` (``ParallelPlan.derive`` with the model's layers), as the formulas need
    them: the plan gives the sizes, micro-batches, the layers of each stage and chunk, the sequence length, the dtype,
    ``--sequence-parallel`` (SP with TP 1 is a no-op, as in training) and the recompute choice."""

    model: ModelConfig
    plan: ParallelPlan
    zero_stage: int = 2
    reduce_bucket_size: int = 500_000_000  # DeepSpeed's defaults, in elements
    allgather_bucket_size: int = 500_000_000
    # Where the model runs: "cuda" (fused SDPA always; dropout keeps 1-byte masks), "cpu" (fused SDPA without
    # attention dropout, else torch's math path; dropout keeps its scaled mask in the compute dtype) or any other
    # name for a device without a fused attention kernel (the planner's "unfused": 1-byte masks, s x s kept).
    device: str = "cuda"

    @classmethod
    def from_run(cls, model: ModelConfig, plan: ParallelPlan, ds_config: dict | None = None,
                 device: str = "cpu") -> "Workload":
        """The workload of a training run: its model (vocabulary resolved), plan, DeepSpeed config (ZeRO stage and
        buckets) and device type."""
        zero = (ds_config or {}).get("zero_optimization", {})
        return cls(model, plan, zero_stage=int(zero.get("stage", cls.zero_stage)),
                   reduce_bucket_size=int(zero.get("reduce_bucket_size", cls.reduce_bucket_size)),
                   allgather_bucket_size=int(zero.get("allgather_bucket_size", cls.allgather_bucket_size)),
                   device=device)

    def __post_init__(self) -> None:
        """The plan (``ParallelPlan.derive``: every layout rule checked there) must be this model's: its activation
        shape and its layer split."""
        num_layers, pp, v = self.model.num_layers, self.plan.dims.pp_size, self.plan.num_chunks
        if self.plan.seq_length < 1 or self.plan.hidden_size not in (0, self.model.hidden_size):
            raise ValueError(f"the plan's activation shape (--seq-length {self.plan.seq_length}, hidden "
                             f"{self.plan.hidden_size}) does not fit the model (hidden {self.model.hidden_size})")
        ranges, chunks = self.plan.stage_layers, self.plan.chunk_layers
        if len(ranges) != pp or not covers_each_layer_once(ranges, num_layers):
            raise ValueError(f"{num_layers} layers do not split into {pp} pipeline stages as "
                             f"{list(ranges) or 'the plan has none'}: derive the plan with the model's --num-layers "
                             f"(ParallelPlan.derive)")
        if v > 1 and (len(chunks) != pp or any(len(c) != v for c in chunks)):
            raise ValueError(f"the plan's chunk_layers give {[len(c) for c in chunks]} chunks per stage: "
                             f"want {v} on each of the {pp} stages")

    # The sizes as Topology names them: the formulas' t, p, d; and the plan's values the formulas read.
    tp_size = property(lambda self: self.plan.dims.tp_size)
    pp_size = property(lambda self: self.plan.dims.pp_size)
    dp_size = property(lambda self: self.plan.dims.dp_size)
    cp_size = property(lambda self: self.plan.dims.cp_size)  # n
    dp_cp_size = property(lambda self: self.plan.dims.dp_cp_size)  # ZeRO's group: d n
    num_chunks = property(lambda self: self.plan.num_chunks)  # v
    seq_length = property(lambda self: self.plan.seq_length)  # s, the whole sequence
    local_seq_length = property(lambda self: self.plan.local_seq_length)  # s/n: the tokens the formulas' s counts
    dtype_bytes = property(lambda self: self.plan.dtype_bytes)  # e
    sequence_parallel = property(lambda self: self.plan.sequence_parallel)
    recompute = property(lambda self: self.plan.recompute)
    sp = property(lambda self: self.plan.sp)  # sequence parallelism in effect (TP > 1)

    @property
    def dp_group(self) -> str:
        """The group ZeRO reduces gradients over, as ``Topology.named_groups`` names it: DP, or DP x CP under CP."""
        return "dp_cp" if self.cp_size > 1 else "dp"

    @property
    def checkpoint_activations(self) -> bool:
        """Full recompute (``--checkpoint-activations``)."""
        return self.recompute.is_full

    def layers_on(self, pp_rank: int) -> int:
        return len(self.plan.stage_layers[pp_rank])

    def first(self, pp_rank: int) -> bool:
        return pp_rank == 0

    def last(self, pp_rank: int) -> bool:
        return pp_rank == self.pp_size - 1

    def chunk_sizes(self, pp_rank: int) -> list[int]:
        """Layers of each model chunk of stage ``pp_rank`` (one chunk, the stage, without interleaving)."""
        return [len(c) for c in self.plan.rank_chunks(pp_rank)]

    def first_chunk(self, pp_rank: int, chunk: int) -> bool:
        """The first virtual stage (it embeds the ids): chunk 0 of the first stage."""
        return self.first(pp_rank) and chunk == 0

    def last_chunk(self, pp_rank: int, chunk: int) -> bool:
        """The last virtual stage (final LayerNorm, top query layer, output layer, loss)."""
        return self.last(pp_rank) and chunk == self.num_chunks - 1

    def top_query_on(self, pp_rank: int) -> bool:
        """Whether stage ``pp_rank`` runs the top query layer (the last one does, if the model has it)."""
        return self.last(pp_rank) and self.model.top_query_layer

    def describe(self) -> str:
        """The training options the formulas depend on, in words: for reports."""
        interleaved = f", interleaved 1F1B with {self.num_chunks} chunks per rank" if self.num_chunks > 1 else ""
        if self.cp_size > 1:
            attention = f"ring attention over CP {self.cp_size} ({self.local_seq_length} tokens per rank)"
        else:
            attention = f"{'fused' if fused_attention(self) else 'unfused (s x s kept)'} attention"
        return (f"sequence parallel {'on' if self.sp else 'off'}, recompute {self.recompute.describe()}, "
                f"{attention}{interleaved}")


# --------------------------------------------------------------------------------------------- parameters

def norm_parameters(model: ModelConfig) -> int:
    """One norm's parameters: LayerNorm's weight and bias, RMSNorm's weight alone."""
    return model.hidden_size * (1 if model.normalization == "RMSNorm" else 2)


def replicated_layer_parameters(model: ModelConfig) -> int:
    """What every TP rank of a layer holds whole: the two norms and the row-parallel biases (attention dense, MLP
    out; none under --disable-bias-linear). Under SP these are the layer's sequence-parallel parameters."""
    return 2 * norm_parameters(model) + (2 * model.hidden_size if model.linear_bias else 0)


def layer_parameters(model: ModelConfig, tp: int, top_query: bool = False) -> int:
    """One transformer layer's parameters on one TP rank (model/shapes.py ``model_parameter_shapes``, split as
    ``partition_spec`` splits them): [Q; K; V] of (n + 2g) d rows (g = n without GQA), the dense h x n d, the MLP's
    h -> ffn (2 ffn rows, [gate; up], under --swiglu) and ffn -> h. ``top_query``: the top query layer, whose
    attention stays multi-head (query h rows, key_value 2h)."""
    h, ffn = model.hidden_size, model.ffn_hidden_size
    qkv = 3 * h if top_query else h + 2 * model.kv_size
    split = (qkv * h + (qkv if model.qkv_bias else 0) + h * h  # QKV (its bias iff qkv_bias), dense
             + model.mlp_in_size * h + (model.mlp_in_size if model.linear_bias else 0) + ffn * h)  # h->ffn, ffn->h
    return replicated_layer_parameters(model) + split // tp


def stage_parameters(w: Workload, pp_rank: int) -> int:
    """Parameters held by one rank of stage ``pp_rank``. Tied (CodeGeeX's, GPT-2's) both copies of the word table
    count: each end holds, trains and stores its own. Untied (--untie-embeddings-and-output-weights) the word table
    is on the first stage and the output layer, its own (V, h) weights, on the last. Under RoPE there is no position
    table and the top query table has one row (``ModelConfig.position_table_rows``, ``top_query_rows``)."""
    m, h = w.model, w.model.hidden_size
    n = w.layers_on(pp_rank) * layer_parameters(m, w.tp_size)
    if w.first(pp_rank):
        n += m.padded_vocab_size // w.tp_size * h + m.position_table_rows * h
    if w.last(pp_rank):
        n += norm_parameters(m)  # final norm
        if m.top_query_layer:
            n += m.top_query_rows * h + layer_parameters(m, w.tp_size, top_query=True)
        if not m.tied_output or not w.first(pp_rank):
            n += m.padded_vocab_size // w.tp_size * h  # the output layer (untied), or its copy of the word table
    return n


def largest_parameter(w: Workload, pp_rank: int) -> int:
    """Elements of the largest single parameter on one rank of stage ``pp_rank``."""
    m, h, t = w.model, w.model.hidden_size, w.tp_size
    sizes = ([(h + 2 * m.kv_size) * h // t, m.mlp_in_size * h // t] if w.layers_on(pp_rank) or w.last(pp_rank)
             else [0])
    if w.first(pp_rank) or w.last(pp_rank):
        sizes.append(m.padded_vocab_size // t * h)
    if w.first(pp_rank):
        sizes.append(m.position_table_rows * h)
    if w.last(pp_rank) and m.top_query_layer:
        sizes.append(m.top_query_rows * h)
    return max(sizes)


def sequence_parallel_parameters(w: Workload, pp_rank: int) -> int:
    """Elements of the sequence-parallel parameters on one rank of stage ``pp_rank`` (replicated over TP, applied to
    this rank's part of the sequence): per layer the two norms and the two row-parallel biases
    (``replicated_layer_parameters``: 6h for CodeGeeX's LayerNorms with biases, 2h for RMSNorm without biases); the
    position table on the first stage; the final norm and the top query table on the last. Their gradients are
    all-reduced over TP once per micro-batch backward (tensor_parallel/layers.py). None without SP."""
    if not w.sp:
        return 0
    m, h = w.model, w.model.hidden_size
    n = (w.layers_on(pp_rank) + w.top_query_on(pp_rank)) * replicated_layer_parameters(m)
    if w.first(pp_rank):
        n += m.position_table_rows * h
    if w.last(pp_rank):
        n += norm_parameters(m) + (m.top_query_rows * h if m.top_query_layer else 0)
    return n


# ------------------------------------------------------------------------------------------ communication

GROUPS = ("tp", "pp", "dp", "embedding")  # and, under CP, "cp" and "dp_cp"
# The TP bytes of one micro-batch, by cause (tp_bytes_per_microbatch).
TP_TERMS = ("activations", "loss", "recompute", "sp_regather", "sp_parameter_gradients")
# The CP bytes of one micro-batch, by cause (cp_bytes_per_microbatch).
CP_TERMS = ("forward", "backward", "recompute")


def tp_bytes_per_microbatch(w: Workload, pp_rank: int = 0) -> dict[str, int]:
    """Bytes one rank of stage ``pp_rank`` moves in its TP group per micro-batch, by cause (counted as in
    ``accounting.counter``: an all-reduce of N bytes moves 2N, an all-gather or a reduce-scatter of N moves N).

    activations   the f/g pairs at the TP regions' edges, forward and backward: per layer one all-reduce of phi
                  forward (g) and one backward (f) for the attention and the MLP each, 8 phi; the top query layer's
                  queries enter through their own f (2 phi); the vocab-parallel embedding's all-reduce (2 phi,
                  forward) and the output layer's f (2 phi, backward). Under sequence parallelism every all-reduce
                  of phi becomes an all-gather plus a reduce-scatter of phi each (embedding: reduce-scatter forward,
                  all-gather backward; output layer: the reverse): the same bytes, 8 phi per layer.
    loss          the vocab-parallel cross entropy, fp32: row max, then (sum of exp, target logit): 24 b s.
    recompute     full recompute re-runs the forward collectives of each recomputed layer (its units are per model
                  chunk): 4 phi (two all-reduces, or two all-gathers and two reduce-scatters); the top query layer's
                  also re-gathers its queries under SP (5 phi). Selective recompute re-runs no collective.
    sp_regather   SP only: a column-parallel linear keeps its input split and all-gathers it again in backward for
                  its weight gradient (phi each): QKV and h->4h per layer, query, key_value and h->4h in the top
                  query layer.
    sp_parameter_gradients
                  SP only: the TP all-reduce of the sequence-parallel parameters' gradients, once per micro-batch
                  backward, in the parameters' dtype: 2 x their elements x e (``sequence_parallel_parameters``).

    So SP = the TP activation bytes (unchanged) + the re-gathers + the SP-parameter gradients (+ phi per
    recomputed top query layer). Under CP every term but the last moves the rank's s/n tokens; the loss needs no
    CP collective (each rank divides by the micro-batch's whole token count)."""
    m = w.model
    terms = dict.fromkeys(TP_TERMS, 0)
    if w.tp_size == 1:
        return terms
    b, s, e = w.plan.micro_batch_size, w.local_seq_length, w.dtype_bytes
    phi = b * s * m.hidden_size * e
    layers, top_query = w.layers_on(pp_rank), w.top_query_on(pp_rank)
    terms["activations"] = (layers + top_query) * 8 * phi + (2 * phi if top_query else 0)
    if w.first(pp_rank):
        terms["activations"] += 2 * phi  # vocab-parallel embedding
    if w.last(pp_rank):
        terms["activations"] += 2 * phi  # output layer (tied word table)
        terms["loss"] = 2 * (b * s * 4) + 2 * (2 * b * s * 4)
    sizes = w.chunk_sizes(pp_rank)  # full recompute's units are per model chunk
    recomputed = sum(full_unit_counts(w.recompute, n)[1] for n in sizes)
    terms["recompute"] = recomputed * 4 * phi
    if top_query and w.recompute.covers_top_query_layer(sizes[-1]):
        terms["recompute"] += 4 * phi + (phi if w.sp else 0)
    if w.sp:
        terms["sp_regather"] = layers * 2 * phi + (3 * phi if top_query else 0)
        terms["sp_parameter_gradients"] = 2 * sequence_parallel_parameters(w, pp_rank) * e
    return terms


def recomputed_attentions(w: Workload, pp_rank: int = 0) -> int:
    """Attentions of stage ``pp_rank`` whose forward runs again in backward, per micro-batch: full recompute's
    recomputed layers (and the top query layer when a unit covers it), or every attention under selective
    recompute of ``core_attn`` (its ``checkpoint`` re-runs the attention core itself)."""
    rc, sizes, top_query = w.recompute, w.chunk_sizes(pp_rank), w.top_query_on(pp_rank)
    if rc.selects("core_attn"):
        return w.layers_on(pp_rank) + top_query
    recomputed = sum(full_unit_counts(rc, n)[1] for n in sizes)
    return recomputed + (1 if top_query and rc.covers_top_query_layer(sizes[-1]) else 0)


def cp_bytes_per_microbatch(w: Workload, pp_rank: int = 0) -> dict[str, int]:
    """Bytes one rank of stage ``pp_rank`` sends in its CP group per micro-batch, by cause: every attention (each
    layer's and the top query layer's) is one ring attention over the n CP ranks (context_parallel/ring_attention.py,
    ``ring_attention_bytes``), its K/V and dK/dV (b, g/t, s/n, d) in the compute dtype, g the key-value groups (a
    without grouped-query attention, and in the top query layer, which is multi-head), kv = 2 b (s/n) g d e / t:

    forward    n - 1 hops of this rank's K and V: (n - 1) kv per attention
    backward   n - 1 hops of K and V again and n of the travelling dK/dV (the last one home): (2n - 1) kv
    recompute  the forward's n - 1 hops again for each attention recomputation re-runs (``recomputed_attentions``)

    Nothing at CP 1. Sent with batch_isend_irecv, counted by its sender."""
    terms = dict.fromkeys(CP_TERMS, 0)
    if w.cp_size == 1:
        return terms
    m = w.model

    def ring(kv_heads: int):
        return ring_attention_bytes(w.plan.micro_batch_size, kv_heads // w.tp_size, w.local_seq_length, m.head_dim,
                                    w.cp_size, w.dtype_bytes)

    layer, top_query = ring(m.kv_groups), ring(m.num_attention_heads)  # the top query layer is multi-head
    layers, top = w.layers_on(pp_rank), w.top_query_on(pp_rank)
    terms["forward"] = layers * layer.forward + top * top_query.forward
    terms["backward"] = layers * layer.backward + top * top_query.backward
    again = recomputed_attentions(w, pp_rank)
    top_again = 1 if top and again > recomputed_layer_attentions(w, pp_rank) else 0
    terms["recompute"] = (again - top_again) * layer.forward + top_again * top_query.forward
    return terms


def recomputed_layer_attentions(w: Workload, pp_rank: int = 0) -> int:
    """``recomputed_attentions`` of the regular layers alone (the top query layer left out)."""
    if w.recompute.selects("core_attn"):
        return w.layers_on(pp_rank)
    return sum(full_unit_counts(w.recompute, n)[1] for n in w.chunk_sizes(pp_rank))


def comm_bytes_per_step(w: Workload, pp_rank: int = 0) -> dict[str, int]:
    """Bytes one rank of stage ``pp_rank`` moves per optimizer step, by group, counted as in
    ``accounting.counter`` (an all-reduce of N bytes moves 2N; p2p counts what this rank sends).

    pp: each micro-batch's forward of each of the v chunks sends its output on and its backward sends its input
    gradient back, except that the last virtual stage (the last stage's last chunk) ends in the loss and the first
    (the first stage's chunk 0) starts from the ids: (2 m v - m [first stage] - m [last stage]) x phi, of the plan's
    ``p2p_shape`` ((b, s/n, h), (b, s/n/t, h) under SP). v = 1 is 1F1B's 2m, m at either end.

    Under CP (n > 1) two more groups: "cp", m x ``cp_bytes_per_microbatch``; and ZeRO's traffic is in "dp_cp" (the
    DP x CP group DeepSpeed reduces over: ``Workload.dp_group``), "dp" then moving nothing. At CP 1 neither key."""
    m = w.model
    b, s, h, e = w.plan.micro_batch_size, w.local_seq_length, m.hidden_size, w.dtype_bytes
    out = dict.fromkeys(GROUPS, 0)
    if w.cp_size > 1:
        out.update(cp=w.plan.num_microbatches * sum(cp_bytes_per_microbatch(w, pp_rank).values()), dp_cp=0)
    out["tp"] = w.plan.num_microbatches * sum(tp_bytes_per_microbatch(w, pp_rank).values())
    if w.pp_size > 1:
        v = w.num_chunks
        sends = (v - w.last(pp_rank)) + (v - w.first(pp_rank))  # activations down, gradients up, per micro-batch
        out["pp"] = w.plan.num_microbatches * sends * b * (s // w.tp_size if w.sp else s) * h * e  # p2p_shape
    grad_bytes = 4 if w.dtype_bytes == 4 else w.dtype_bytes  # ZeRO reduces gradients in the param dtype
    tied = m.padded_vocab_size // w.tp_size * h * 4  # fp32 full gradient of the word table
    # Tied, the two copies' gradients are summed (pipeline/shared_embedding.py); untied, the output layer is a
    # parameter of the last stage alone: no embedding group traffic, its gradient reduced over DP like any other.
    shares_table = m.tied_output and w.pp_size > 1 and (w.first(pp_rank) or w.last(pp_rank))
    if shares_table:
        out["embedding"] = 2 * tied
    if w.dp_cp_size > 1:
        params = stage_parameters(w, pp_rank)
        # ZeRO-2 all-reduces every micro-batch's gradients bucket by bucket (DeepSpeed's reduce_scatter is a
        # bucket all-reduce plus slicing), then all-gathers the updated weights after the step.
        dp = w.plan.num_microbatches * 2 * params * grad_bytes + dp_allgather_bytes(w, pp_rank)
        if shares_table:
            dp += 2 * tied  # safe_get_full_grad of the tied copy: one all-reduce over DP
        out[w.dp_group] = dp
    return out


def dp_allgather_bytes(w: Workload, pp_rank: int) -> int:
    """ZeRO-2's all-gather of the updated weights after the step, per rank of stage ``pp_rank`` (part of "dp", or of
    "dp_cp" under CP)."""
    return stage_parameters(w, pp_rank) * w.dtype_bytes if w.dp_cp_size > 1 else 0


# ------------------------------------------------------------------------------------------------- memory

def korthikanti_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                selective: bool = False) -> float:
    """The paper's activation bytes per layer (fp16), for comparison with ours."""
    sbh, attention = s * b * h, 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 / t + (0 if selective else attention / t))
    return sbh * (10 + 24 / t + (0 if selective else attention / t))


def fused_attention(w: Workload) -> bool:
    """Whether SDPA runs a fused kernel that keeps no s x s probabilities: always on CUDA (flash or
    memory-efficient, dropout included); on CPU only without attention dropout (else torch's math path); never on
    another device (the planner's "unfused")."""
    if w.device == "cuda":
        return True
    return w.device == "cpu" and w.model.attention_dropout == 0.0


def _mask_bytes(w: Workload, p: float) -> int:
    """Bytes per element of what dropout with probability ``p`` keeps for backward."""
    if p == 0.0:
        return 0
    return w.dtype_bytes if w.device == "cpu" else 1


def window_masked(w: Workload) -> bool:
    """Whether attention runs with a mask instead of SDPA's causal flag: the sliding window's (1, 1, s, s) band
    (--window-size; model/attention.py's ``training_attention_mask``), without CP (the ring masks block by block)."""
    return w.model.window_size is not None and w.cp_size == 1


def attention_core_bytes(w: Workload, top_query: bool = False) -> int:
    """What the attention core (QK^T, softmax, dropout, x V) keeps beyond Q, K, V and its output, one rank. Under CP
    the ring attention (any device) keeps its merged output (b, a/t, s/n, h/a), which the dense layer's input is a
    copy of, and the fp32 log-sum-exp: e sbh / t + 4 a s b / t at the local s; never an s x s block (its dropout
    masks are redrawn in backward).

    Grouped-query attention (kv = g d < h) keeps its K and V as g groups only where SDPA takes them so (enable_gqa):
    a fused kernel on the causal path. Behind a mask (the sliding window) they are repeated to the a heads first
    (context_parallel/ring_attention.py's ``sdpa``: the memory-efficient kernel has no enable_gqa), and the math path
    repeats them itself: 2 e s b (h - kv) / t more, the repeated copies being what SDPA keeps (a masked fused call
    without RoPE keeps 2 e s b kv / t more: its groups are views of the fused QKV output, which the queries keep
    alive). A masked fused call also keeps the additive mask SDPA makes of the bool band, in the compute dtype:
    e s^2 per attention (broadcast over the batch and the heads, the same on every TP rank); the math path adds the
    mask to the scores and keeps nothing of it. The top query layer (``top_query``) is multi-head: nothing to
    repeat. Measured on CPU (torch 2.13: the fused flash kernel and the math path); the CUDA kernels are assumed to
    keep the same (flash takes enable_gqa; the memory-efficient kernel keeps its attention bias)."""
    m = w.model
    b, s, a, e, t = w.plan.micro_batch_size, w.local_seq_length, m.num_attention_heads, w.dtype_bytes, w.tp_size
    if w.cp_size > 1:
        return e * s * b * m.hidden_size // t + 4 * a * s * b // t
    kv = m.hidden_size if top_query else m.kv_size
    repeated_kv = 2 * e * s * b * (m.hidden_size - kv) // t  # beside the groups "qkv" counts
    if fused_attention(w):
        lse = 4 * a * s * b // t  # fp32 log-sum-exp per head and query
        if not window_masked(w):
            return lse
        viewed_groups = 2 * e * s * b * kv // t if kv < m.hidden_size and not m.rope else 0
        return lse + repeated_kv + viewed_groups + e * s * s
    probs = e * a * s * s * b // t
    if m.attention_dropout == 0.0:
        return probs + repeated_kv
    return probs + (_mask_bytes(w, m.attention_dropout) + e) * a * s * s * b // t + repeated_kv


def layer_activation_bytes(w: Workload, top_query: bool = False) -> dict[str, int]:
    """Bytes one transformer layer keeps for backward on one rank, by tensor; the top query layer with
    ``top_query``. Selective recompute's modules are left out; full recompute is the stage's business
    (``activation_parts``).

    What autograd keeps for one micro-batch's backward, tensor by tensor, as measured with saved-tensor hooks
    (accounting/memory.py; tests/accounting/test_comm_accounting.py). Per layer, on one rank (r = t under SP, else 1):

      kept whole, or s/t of it under SP (/r)         kept by the TP rank's heads and MLP columns (/t)
      LayerNorm inputs           2 e sbh             Q, K, V (the QKV output)      e sb (h + 2 kv)
      LayerNorm mean, rstd       2 x 2 x 4 sb        attention output (dense in)     e sbh
        (RMSNorm: rstd only      2 x 4 sb)           MLP activation input            e f sb (SwiGLU: 2 e f sb)
      column-parallel inputs     2 e sbh             MLP activation output           e f sb
      hidden dropout masks       2 k sbh             attention core: fused 4 a s b (fp32 log-sum-exp); math path
                                                     e a s^2 b (probabilities) + (k' + e) a s^2 b with dropout
                                                     (its mask, the dropped probabilities); GQA and the window:
                                                     ``attention_core_bytes``

    k = dropout mask bytes per element: 1 on CUDA (a bool mask), e on CPU (torch multiplies by a scaled noise tensor
    in the input dtype), 0 without dropout; k' the same for attention dropout. The top query layer also keeps its
    query input (e sbh / r: the position queries). Selective recompute drops ``core_attn``: the attention core term
    (with a fused kernel only its log-sum-exp, 4 a s b / t: there is no s x s to drop; Q, K, V and the attention
    output are kept either way), ``mlp_act``: the activation output, ``layernorm``: the two column-parallel inputs.
    Full recompute keeps only each unit's input (e sbh / r; the top query layer's unit: its hidden and query inputs).
    Under RoPE each model chunk keeps the shared (cos, sin) tables (``activation_parts``); the attention keeps the
    rotated q and k and a copy of v instead of the QKV output (model/attention.py), the same 3 e sbh / t. Under CP, s
    is the rank's s/n and the attention core is the ring's (``attention_core_bytes``). Per stage: the first keeps the
    ids (int64; under TP the local ids and the out-of-range mask) and the embedding dropout mask; the last the final
    LayerNorm's input and statistics, the output layer's input (e sbh, gathered whole under SP, as Megatron's output
    layer keeps it) and the loss's fp32 exp(logits) (4 b s V / t) and per-token numbers.

    kv = h without grouped-query attention (and in the top query layer). SwiGLU (model/mlp.py) keeps its [gate; up]
    input alone and recomputes the sigmoid; its output, the product, is the second linear's input (``mlp_act``
    drops it). RMSNorm (model/norms.py) keeps its input and one fp32 rstd per token.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", fp16, 1-byte masks,
    no fused attention, LayerNorm statistics ignored), per layer:
      no parallelism        sbh (34 + 5 a s / h)
      TP                    sbh (10 + 24 / t + 5 a s / (h t))
      TP + SP               sbh (34 / t + 5 a s / (h t))
      TP + SP + selective   sbh 34 / t
      full recompute        2 sbh (the layer input)
    Ours at e = 2, k = k' = 1, math-path attention is exactly these plus the LayerNorm statistics (16 sb / r) and,
    in the top query layer, its query input: 10 = 2 x 2 (LN inputs) + 2 x 2 (column inputs) + 2 x 1 (masks),
    24 = 2 x 3 (QKV) + 2 (dense input) + 2 x 2 x 4 (activation in and out, f = 4h), 5 = 2 + 1 + 2 (probabilities,
    mask, dropped). With a fused kernel the 5 a s / h term becomes 4 a / h (the log-sum-exp, in sbh / t units), so
    SP, not selective recompute, is what saves memory on CUDA; selective's ``mlp_act`` (8 sbh / t) and
    ``layernorm`` (4 sbh / r) are the further choices.
    """
    m = w.model
    b, s, h, f = w.plan.micro_batch_size, w.local_seq_length, m.hidden_size, m.ffn_hidden_size
    e, t = w.dtype_bytes, w.tp_size
    r = t if w.sp else 1
    sbh, rc = s * b * h, w.recompute
    kv = h if top_query else m.kv_size  # the top query layer stays multi-head
    return {
        "layernorm_inputs": 2 * e * sbh // r,
        "layernorm_statistics": 2 * norm_statistics_bytes(m, s * b) // r,
        "column_inputs": (0 if rc.selects("layernorm") else 2 * e * sbh // r) + (e * sbh // r if top_query else 0),
        "dropout_masks": 2 * _mask_bytes(w, m.hidden_dropout) * sbh // r,
        "qkv": e * s * b * (h + 2 * kv) // t,
        "attention_output": e * sbh // t,
        "attention_core": 0 if rc.selects("core_attn") else attention_core_bytes(w, top_query),
        "mlp_activation_input": e * s * b * m.mlp_in_size // t,
        "mlp_activation_output": 0 if rc.selects("mlp_act") else e * s * b * f // t,
    }


def norm_statistics_bytes(model: ModelConfig, tokens: int) -> int:
    """What one norm keeps per token beyond its input, fp32: LayerNorm's mean and rstd, RMSNorm's rstd
    (model/norms.py)."""
    return (1 if model.normalization == "RMSNorm" else 2) * 4 * tokens


def full_unit_counts(rc: Recompute, num_layers: int) -> tuple[int, int, int]:
    """(units, layers recomputed, layers in the largest unit) of ``rc.full_units(num_layers)``, counted without
    listing the units (a memory check of --num-layers 10**9 must not build a billion ranges)."""
    if not rc.is_full or num_layers == 0:
        return 0, 0, 0
    if rc.method == "block":
        n = min(rc.num_layers, num_layers)
        return n, n, 1
    return -(-num_layers // rc.num_layers), num_layers, min(rc.num_layers, num_layers)


def activation_parts(w: Workload, pp_rank: int = 0, chunk: int | None = None) -> dict[str, int]:
    """What one rank of stage ``pp_rank`` keeps for one micro-batch's backward, by part: ``layers`` (the stage's
    regular layers), ``top_query_layer``, ``embedding`` (first stage), ``output`` (last stage: final LayerNorm,
    output layer, loss), ``rotary`` (RoPE: the (cos, sin) tables (2, b, s, 1, r/2) a chunk's attentions share, e
    each), ``window_mask`` (--window-size under recompute: the chunk's (1, 1, s, s) bool band, kept once as an input of
    the recomputed attentions; without recompute each attention keeps its own additive copy, counted in the
    layers). ``chunk``: the forward of that model chunk alone (interleaved 1F1B: its 1/v of the stage's layers, the
    embedding in the first virtual stage, the rest in the last); None: every chunk of the stage."""
    if chunk is None:
        per_chunk = [activation_parts(w, pp_rank, c) for c in range(w.num_chunks)]
        return {k: sum(parts[k] for parts in per_chunk) for k in per_chunk[0]}
    m = w.model
    b, s, h, e, t = w.plan.micro_batch_size, w.local_seq_length, m.hidden_size, w.dtype_bytes, w.tp_size
    r = t if w.sp else 1
    sbh = s * b * h
    layers = w.chunk_sizes(pp_rank)[chunk]
    first, last = w.first_chunk(pp_rank, chunk), w.last_chunk(pp_rank, chunk)
    layer = sum(layer_activation_bytes(w).values())
    units, recomputed, _ = full_unit_counts(w.recompute, layers)
    parts = {"layers": (layers - recomputed) * layer + units * e * sbh // r,
             "top_query_layer": 0, "embedding": 0, "output": 0, "rotary": 0, "window_mask": 0}
    if m.rope and (layers or (last and m.top_query_layer)):
        parts["rotary"] = b * s * m.rotary_dim * e
    top_query_recomputed = last and m.top_query_layer and w.recompute.covers_top_query_layer(layers)
    if window_masked(w) and (w.recompute.selects("core_attn") and (layers or last and m.top_query_layer)
                             or recomputed or top_query_recomputed):
        parts["window_mask"] = s * s  # the chunk's bool band, an input recomputation keeps by reference
    if last and m.top_query_layer:
        if w.recompute.covers_top_query_layer(layers):
            parts["top_query_layer"] = 2 * e * sbh // r  # the unit's inputs: hidden states and queries
        else:
            parts["top_query_layer"] = sum(layer_activation_bytes(w, top_query=True).values())
    ids = 8 * b * s  # int64 token or position ids
    if first:
        # token ids (TP: the local ids and the out-of-range mask), position ids (none under RoPE: no table), the
        # embedding dropout mask
        positions = 0 if m.rope else ids
        parts["embedding"] = ids + (b * s if t > 1 else 0) + positions + _mask_bytes(w, m.hidden_dropout) * sbh // r
    if last:
        final_layernorm = e * sbh // r + norm_statistics_bytes(m, s * b) // r
        logits_input = e * sbh  # all-gathered under SP
        # exp(logits); the sum of exp (under TP a view of the all-reduced (sum, target logit) pair), local target
        # ids, two masks
        loss = 4 * b * s * m.padded_vocab_size // t + ((8 if t > 1 else 4) + 8 + 1 + 1) * b * s
        # the top query lookup's indices: the position ids (shared with the position table's on a first stage), or
        # under RoPE a zeros tensor of their shape (its one row)
        positions = ids if m.top_query_layer and (m.rope or not first) else 0
        parts["output"] = final_layernorm + logits_input + loss + positions
    return parts


def activation_bytes_per_microbatch(w: Workload, pp_rank: int = 0) -> int:
    """Bytes autograd keeps for one micro-batch's backward on one rank of stage ``pp_rank`` (``activation_parts``
    summed): what ``accounting.memory.SavedActivations`` measures."""
    return sum(activation_parts(w, pp_rank).values())


def chunk_activation_bytes(w: Workload, pp_rank: int = 0) -> list[int]:
    """``activation_bytes_per_microbatch`` by model chunk: what one micro-batch's forward of each chunk keeps."""
    return [sum(activation_parts(w, pp_rank, c).values()) for c in range(w.num_chunks)]


def recompute_working_bytes(w: Workload, pp_rank: int = 0) -> int:
    """What recomputation rebuilds in backward, transiently, on top of the saved activations: under full recompute
    the largest unit's activations (one unit at a time; units are per model chunk), under selective the dropped
    parts of one layer."""
    sizes, rc = w.chunk_sizes(pp_rank), w.recompute
    top_query = w.top_query_on(pp_rank)
    if rc.is_full:
        kept = replace(w, plan=replace(w.plan, recompute=Recompute()))
        layer = sum(layer_activation_bytes(kept).values())
        units = [full_unit_counts(rc, n)[2] * layer for n in sizes]
        if top_query and rc.covers_top_query_layer(sizes[-1]):
            units.append(sum(layer_activation_bytes(kept, top_query=True).values()))
        return max(units, default=0)
    if rc.granularity == "selective" and (any(sizes) or top_query):
        kept = replace(w, plan=replace(w.plan, recompute=Recompute()))
        dropped = [sum(layer_activation_bytes(kept, q).values()) - sum(layer_activation_bytes(w, q).values())
                   for q in ([False] if any(sizes) else []) + ([True] if top_query else [])]
        return max(dropped)
    return 0


def ring_block_bytes(w: Workload, pp_rank: int = 0) -> int:
    """The ring attention's working set (CP > 1), transient, on top of what is saved: a ring step computes one block
    of scores in fp32 (context_parallel/ring_attention.py), the largest being a rank's own, step 0's (all s/n of its
    queries by all s/n of its keys: b a/t (s/n)^2 per tensor), and its backward holds the most at once: the
    probabilities, dP, dP - D and dS, 4 fp32 tensors (with attention dropout also the 1-byte keep mask and the
    dropped probabilities; measured on CPU). One attention's at a time, on a stage that runs one; the ring's K/V
    buffers and fp32 gradients (O(s h / n t)) are left out. 0 at CP 1 (a fused kernel keeps no block; the math
    path's s x s is in the saved activations)."""
    if w.cp_size == 1 or not (w.layers_on(pp_rank) or w.top_query_on(pp_rank)):
        return 0
    m = w.model
    per_element = 4 * 4 + (1 + 4 if m.attention_dropout > 0.0 else 0)
    s = w.local_seq_length
    return per_element * w.plan.micro_batch_size * (m.num_attention_heads // w.tp_size) * s * s


def microbatches_in_flight(w: Workload, pp_rank: int) -> int:
    """1F1B: stage i holds the activations of at most p - i micro-batches at once. Interleaved (v > 1): at most
    min(2(p - i - 1) + (v - 1)p + 1, m v) (micro-batch, chunk) pairs, its warm-up plus one (pipeline/schedules.py)."""
    p, m, v = w.pp_size, w.plan.num_microbatches, w.num_chunks
    if v == 1:
        return min(p - pp_rank, m)
    return min(2 * (p - pp_rank - 1) + (v - 1) * p + 1, m * v)


def activations_in_flight(per_chunk: Sequence[int], pp_size: int, pp_rank: int, num_microbatches: int) -> int:
    """The most activation bytes a rank holds at once, ``per_chunk[c]`` being what one micro-batch's forward of its
    chunk c keeps: its (interleaved) 1F1B schedule replayed, each forward adding its chunk's bytes and each backward
    freeing them. One chunk: its bytes x min(p - i, m); v chunks: the largest sum over the at most
    ``microbatches_in_flight`` pairs held together (the first and last stages' end chunks are the heavier ones)."""
    if len(per_chunk) == 1:
        return per_chunk[0] * min(pp_size - pp_rank, num_microbatches)
    held = held_chunk_counts(pp_size, pp_rank, num_microbatches, len(per_chunk))
    return max(sum(n * b for n, b in zip(counts, per_chunk)) for counts in held)


@lru_cache(maxsize=1024)
def held_chunk_counts(pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> frozenset:
    """The (micro-batches of chunk 0, of chunk 1, ...) a rank holds after each forward of its interleaved 1F1B
    schedule, the distinct ones (a peak follows a forward; also (0, ...) for a schedule without one). Replayed once
    per schedule: the planner asks for the same one for every micro-batch size and option of a layout."""
    held, seen = [0] * num_chunks, {(0,) * num_chunks}
    for step in interleaved_one_f_one_b(pp_size, pp_rank, num_microbatches, num_chunks):
        held[step.chunk] += 1 if step.kind == "F" else -1
        if step.kind == "F":
            seen.add(tuple(held))
    return frozenset(seen)


@dataclass
class MemoryParts:
    """Bytes per rank by part; ``total`` is their sum. ``recompute`` and ``ring_blocks`` (CP > 1: the ring
    attention's block of scores) are transient (in backward), the others are held at the step boundary
    (activations: during the backward of the micro-batches in flight)."""

    weights: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int
    recompute: int = 0
    ring_blocks: int = 0
    notes: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.buffers + self.activations + self.recompute
                + self.ring_blocks)

    def as_dict(self) -> dict[str, int]:
        """The parts and the total; ``ring_blocks`` only under CP (where it is not 0)."""
        ring = {"ring_blocks": self.ring_blocks} if self.ring_blocks else {}
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "buffers": self.buffers, "activations": self.activations, "recompute": self.recompute, **ring,
                "total": self.total}


def memory_per_rank(w: Workload, pp_rank: int = 0) -> MemoryParts:
    """ZeRO-2 under DeepSpeed: weights whole in the compute dtype; an fp32 master copy, Adam's two moments and
    the gradient, each partitioned over DP (1/d; DP x CP under CP, 1/(d n): DeepSpeed's group there); the gradient
    bucket of reduce_bucket_size elements (the largest parameter when bigger; at most the stage's parameters) and,
    with DP > 1, the all-gather staging; the saved activations of the micro-batches (interleaved: (micro-batch,
    chunk) pairs) in flight and what recomputation rebuilds on top of them; under CP the ring's block."""
    psi = stage_parameters(w, pp_rank)
    e, d = w.dtype_bytes, w.dp_cp_size
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
    activations = activations_in_flight(chunk_activation_bytes(w, pp_rank), w.pp_size, pp_rank,
                                        w.plan.num_microbatches)
    return MemoryParts(weights=psi * e, gradients=gradients, optimizer=optimizer, buffers=bucket,
                       activations=activations, recompute=recompute_working_bytes(w, pp_rank),
                       ring_blocks=ring_block_bytes(w, pp_rank), notes={"parameters": psi, "partition": shard})


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _in_flight(w: Workload, pp_rank: int) -> str:
    n = microbatches_in_flight(w, pp_rank)
    return f"{n} micro-batch(es)" if w.num_chunks == 1 else f"up to {n} (micro-batch, chunk) pairs"


def expected_memory_report(w: Workload) -> str:
    """The start-up lines: predicted memory and bytes moved per step, per rank of each stage, with what sequence
    parallelism, recomputation and context parallelism contribute."""
    cp = f", CP {w.cp_size}" if w.cp_size > 1 else ""
    lines = [f"expected per rank (ZeRO-{w.zero_stage}, DP {w.dp_size}{cp}, {w.dtype_bytes}-byte weights, "
             f"{w.describe()}; measured at the 2nd step as the metrics' 'memory' record):"]
    for pp_rank in range(w.pp_size):
        parts = memory_per_rank(w, pp_rank)
        comm = comm_bytes_per_step(w, pp_rank)
        stage = f"  stage {pp_rank}: " if w.pp_size > 1 else "  "
        rebuilt = f", recompute {_gib(parts.recompute)} (rebuilt in backward)" if parts.recompute else ""
        if parts.ring_blocks:
            rebuilt += f", ring blocks {_gib(parts.ring_blocks)} (transient)"
        lines.append(f"{stage}weights {_gib(parts.weights)}, gradients {_gib(parts.gradients)}, optimizer "
                     f"{_gib(parts.optimizer)}, buffers {_gib(parts.buffers)}, activations {_gib(parts.activations)}"
                     f" ({_in_flight(w, pp_rank)} in flight){rebuilt}: total "
                     f"{_gib(parts.total)}; per step moves "
                     + ", ".join(f"{g} {_gib(n)}" for g, n in comm.items() if n))
        if w.sp or w.recompute.is_full:
            tp = {k: v * w.plan.num_microbatches for k, v in tp_bytes_per_microbatch(w, pp_rank).items() if v}
            lines.append(f"{' ' * len(stage)}tp = " + " + ".join(f"{k.replace('_', ' ')} {_gib(v)}"
                                                                for k, v in tp.items()))
        if w.cp_size > 1:
            cp_terms = {k: v * w.plan.num_microbatches for k, v in cp_bytes_per_microbatch(w, pp_rank).items() if v}
            lines.append(f"{' ' * len(stage)}cp = " + " + ".join(f"ring {k} {_gib(v)}" for k, v in cp_terms.items()))
    return "\n".join(lines)
