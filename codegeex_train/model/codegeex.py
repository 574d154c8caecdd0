"""CodeGeeXModel: one pipeline stage of the GPT decoder with CodeGeeX's top query layer.

    model = CodeGeeXModel.for_rank(config, plan, topology, tracker, seed=1234)  # this rank's part of the plan's model
    model = CodeGeeXModel(config, ModelGroups.from_topology(topology), plan, tracker)  # the same, one stage
    model = CodeGeeXModel(config, seed=1234)                        # one rank: no groups, no plan
    logits_shard = model(input_ids, position_ids)                   # (b, s, v/tp)
    loss = model(input_ids, position_ids, labels=labels)            # (b, s) per-token loss, fp32
    logits = model(input_ids, position_ids, gather_logits=True)     # (b, s, v)
    loss = model(input_ids, position_ids, labels=labels, document_ids=docs)  # packed documents, (b, s) int:
                                                                    # attention stays inside each document
    cache = model.new_kv_cache(batch_size, capacity)                # incremental decoding (generation/):
    logits = model(prompt_ids, position_ids, kv_cache=cache, attention_mask=real_tokens)  # fills the cache,
    logits = model(next_ids, next_position_ids, kv_cache=cache)     # then one (b, 1) step at a time

A stage without ``pre_process`` takes hidden states (b, s, h) instead of ids; one without
``post_process`` returns hidden states. Interleaved 1F1B gives a stage several model chunks (``chunk_layers``,
one tuple of layer numbers each): ``model(x, position_ids, chunk=c)`` runs chunk c's layers only, the embedding
being part of chunk 0 (``pre_process``) and the head of the last chunk (``post_process``); one module, one
state dict with the same global names as a stage holding those layers, so checkpoints do not depend on v. Position ids are always passed: the last stage's top query layer
looks its queries up by position, and under RoPE (--position-embedding-type rope, model/rotary.py) every attention
rotates its queries and keys by them (no learned position table then; the top query table has one row). The logits
use the word table (tied: its copy on the last stage) or, under --untie-embeddings-and-output-weights, ``output_layer``
(last stage only; the word table is then on the first stage only). The norms are --normalization's and the MLP
--swiglu's or --activation's (norms.py, mlp.py). Parameter
names use global layer numbers (``layers.7.mlp...``), so a stage's state dict keys and initial values do not depend
on how the layers are split.

The process groups come as one ``ModelGroups`` (model/groups.py: TP, and CP's under context parallelism), passed
down to every layer; the ``ParallelPlan`` (layout/plan.py) says what runs over them, read once here and by each
layer for what it uses. Training options of the plan that change no parameter: sequence parallelism (``plan.sp``:
hidden states between stages and layers are (b, s/tp, h): each TP rank holds its part of the sequence; the output
layer gathers it), ``plan.recompute`` (layout/recompute.py: full layers or selected parts re-run in backward) and
context parallelism (``plan.cp_size`` > 1: the inputs, position ids and labels are this CP rank's two chunks of each
sequence, positions global; attention is a ring over the CP group, everything else per token). A checkpoint saved
with any of them loads without it. Without a plan the model runs TP over its groups and nothing else. Decoding with
a KV cache never splits the sequence: build the model with a plan without SP or CP (or with none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.model.attention import KVCache, kv_heads_of, training_attention_mask
from codegeex_train.model.groups import ModelGroups
from codegeex_train.model.kv_slots import KVSlots
from codegeex_train.model.embedding import ReplicatedEmbedding, output_layer, parallel_lm_logits, word_embeddings
from codegeex_train.model.init import ParamInit
from codegeex_train.model.norms import layer_norm
from codegeex_train.model.rotary import RopeScaling, rotary_tables
from codegeex_train.model.transformer import ParallelTransformerLayer, TopQueryLayer, sequence_parallel_dropout
from codegeex_train.tensor_parallel import RNGStatesTracker, recompute_activations, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from codegeex_train.distributed.topology import Topology


class CodeGeeXModel(nn.Module):
    """One pipeline stage (by default the whole model) of CodeGeeX; see the module docstring."""

    def __init__(self, config: ModelConfig, groups: ModelGroups | None = None, plan: ParallelPlan | None = None,
                 rng_tracker: RNGStatesTracker | None = None, *, seed: int = 1234, pre_process: bool = True,
                 post_process: bool = True, layer_numbers: Sequence[int] | None = None,
                 chunk_layers: Sequence[Sequence[int]] | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        groups = ModelGroups() if groups is None else groups
        if plan is None:  # TP over the groups, nothing else: no SP, CP or recompute
            plan = ParallelPlan.derive(ParallelDims(groups.tp_size, groups.tp_size), micro_batch_size=1)
        groups.check(plan)
        config.validate(plan.tp_size)  # a bad shape fails here, before any weight or collective
        self.config, self.groups, self.plan, self.rng_tracker = config, groups, plan, rng_tracker
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = plan.sp
        if chunk_layers is not None:
            if layer_numbers is not None:
                raise ValueError("give layer_numbers or chunk_layers, not both")
            layer_numbers = tuple(i for chunk in chunk_layers for i in chunk)
        self.layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.chunk_layers = tuple(tuple(c) for c in chunk_layers) if chunk_layers else (tuple(self.layer_numbers),)
        if self.layer_numbers and (self.layer_numbers[0] < 0 or self.layer_numbers[-1] >= config.num_layers):
            raise ValueError(f"layer_numbers {self.layer_numbers} outside 0..{config.num_layers - 1} (--num-layers)")
        init = ParamInit(seed, config.init_method_std, config.num_layers)
        h, kw = config.hidden_size, {"dtype": dtype, "device": device}
        sp_group = groups.sequence_parallel_group(plan)

        if pre_process or post_process and config.tied_output:  # untied: the input table only
            self.word_embeddings = word_embeddings(config.padded_vocab_size, h, groups.tp, init,
                                                   sequence_parallel=plan.sp, tied=config.tied_output, **kw)
        if pre_process and config.position_table_rows:  # learned_absolute (none under RoPE)
            self.position_embeddings = ReplicatedEmbedding(config.position_table_rows, h, init,
                                                           "position_embeddings.weight", sp_group=sp_group, **kw)
        # Keys are global layer numbers: the names (and so the init seeds) are the same at every PP split.
        self.layers = nn.ModuleDict({
            str(i): ParallelTransformerLayer(config, groups, plan, rng_tracker, init, f"layers.{i}.", **kw)
            for i in self.layer_numbers
        })
        if post_process:
            self.final_layernorm = layer_norm(config, groups, plan, dtype, device)
            if config.top_query_layer:
                # A row per position; under RoPE one row, rotated by the position in the attention
                self.top_query_embeddings = ReplicatedEmbedding(config.top_query_rows, h, init,
                                                                "top_query_embeddings.weight", sp_group=sp_group, **kw)
                self.top_query_layer = TopQueryLayer(config, groups, plan, rng_tracker, init, "top_query_layer.",
                                                     **kw)
            if not config.tied_output:  # the last parameter, as model/shapes.py says
                self.output_layer = output_layer(config.padded_vocab_size, h, groups.tp, init, **kw)
        # Per chunk (each its own model in Megatron): its layer index -> the recompute unit holding it
        self._unit_of = [{i: unit for unit in plan.recompute.full_units(len(c)) for i in unit}
                         for c in self.chunk_layers]
        self._recompute_top_query = plan.recompute.covers_top_query_layer(len(self.chunk_layers[-1]))

    @classmethod
    def for_rank(cls, config: ModelConfig, plan: ParallelPlan, topology: Topology,
                 rng_tracker: RNGStatesTracker | None, *, seed: int = 1234,
                 device: torch.device | str | None = None) -> "CodeGeeXModel":
        """This rank's part of the model as ``plan`` lays it out: its TP shard, its pipeline stage's model chunks,
        the plan's sequence and context parallelism and recompute choice."""
        return cls(config, ModelGroups.from_topology(topology), plan, rng_tracker, seed=seed,
                   pre_process=topology.is_first_stage, post_process=topology.is_last_stage,
                   chunk_layers=plan.rank_chunks(topology.pp_rank), device=device)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_layers)

    tp_group = property(lambda self: self.groups.tp)
    tp_size = property(lambda self: self.groups.tp_size)
    tp_rank = property(lambda self: self.groups.tp_rank)
    recompute = property(lambda self: self.plan.recompute)

    @property
    def output_weight(self) -> torch.nn.Parameter:
        """This rank's (v/tp, h) output-layer weight (last stage): the word table when tied, else output_layer's."""
        return self.word_embeddings.weight if self.config.tied_output else self.output_layer.weight

    @property
    def checkpoint_activations(self) -> bool:
        return self.recompute.is_full

    def _recomputing(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _run_layers(self, hidden: torch.Tensor, chunk: int, mask: tuple[torch.Tensor, ...],
                    rotary: torch.Tensor | None) -> torch.Tensor:
        """The chunk's layers in order; under full recompute each unit keeps its input (and the document mask, if
        any: ``mask`` is () or its one (b, 1, s, s) tensor, and RoPE's tables) only."""
        layers = [self.layers[str(i)] for i in self.chunk_layers[chunk]]
        i = 0
        while i < len(layers):
            unit = self._unit_of[chunk].get(i) if self._recomputing() else None
            if unit is None:
                hidden = layers[i](hidden, *mask, rotary=rotary)
                i += 1
                continue

            def run(x, *mask_, rotary=None, chunk=tuple(layers[j] for j in unit)):
                for layer in chunk:
                    x = layer(x, *mask_, rotary=rotary)
                return x

            hidden = self._recompute(run, hidden, *mask, rotary=rotary)
            i = unit[-1] + 1
        return hidden

    def _recompute(self, function, *args: torch.Tensor, rotary: torch.Tensor | None) -> torch.Tensor:
        """``function(*args, rotary=rotary)`` under full recompute: RoPE's tables, when given, travel as the last
        ``checkpoint`` input (restores both RNG streams on recompute)."""
        if rotary is None:
            return recompute_activations(function, self.rng_tracker, *args)
        return recompute_activations(lambda *a: function(*a[:-1], rotary=a[-1]), self.rng_tracker, *args, rotary)

    def new_kv_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty KVCache for this stage's attentions (its layers, then the top query layer), this rank's
        key-value groups, ``capacity`` positions (prompt + new tokens), in the dtype and on the device of the
        weights."""
        weight = next(self.parameters())
        return KVCache(len(self._kv_heads()), batch_size, capacity, self._kv_heads(), self.config.head_dim,
                       window=self.config.window_size, dtype=weight.dtype, device=weight.device)

    def _kv_heads(self) -> list[int]:
        """The key-value heads this rank caches per attention: g/tp per layer, n/tp for the (multi-head) top query
        layer."""
        top = self.post_process and self.config.top_query_layer
        return kv_heads_of(len(self.layers) + int(top), self.config.kv_groups // self.tp_size,
                           self.config.num_attention_heads // self.tp_size, top)

    def new_kv_slots(self, slots: int, capacity: int, *, prefixes: int, prefix_capacity: int) -> KVSlots:
        """Empty KVSlots (continuous batching, kv_slots.py): ``slots`` rows of ``capacity`` new tokens each, sharing
        ``prefixes`` prompts of up to ``prefix_capacity`` tokens; the same attentions, groups, dtype and device."""
        weight = next(self.parameters())
        return KVSlots(len(self._kv_heads()), slots, capacity, self._kv_heads(), self.config.head_dim,
                       prefixes=prefixes, prefix_capacity=prefix_capacity, window=self.config.window_size,
                       dtype=weight.dtype, device=weight.device)

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                gather_logits: bool = False, kv_cache: KVCache | KVSlots | None = None,
                attention_mask: torch.Tensor | None = None, last_token_only: bool = False,
                chunk: int = 0, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs``: token ids (b, s) on the first stage, hidden states (b, s, h) elsewhere.

        Returns hidden states (b, s, h) unless ``post_process``; then the per-token loss (b, s) fp32
        when ``labels`` are given (vocab-parallel, logits never gathered), else the logits shard
        (b, s, v/tp), or the full logits (b, s, v) with ``gather_logits``.

        Decoding: with ``kv_cache`` the inputs are the s positions after those already cached (their keys
        and values are appended, every attention reads the cached ones); ``attention_mask`` (b, s) bool
        marks real tokens (False: padding, never attended to). ``last_token_only`` computes the logits
        of the last position only (b, 1, ...), the one a decoding step samples from.

        ``chunk``: the model chunk to run (interleaved 1F1B); "first stage" / "last stage" above then mean chunk 0
        of a ``pre_process`` model / the last chunk of a ``post_process`` one.

        Under RoPE every attention of this call rotates its queries and keys by ``position_ids`` (one (cos, sin) table
        computed here, shared by all; decoding passes the new tokens' positions).

        ``document_ids`` (b, s) int, training only (--reset-attention-mask): the document of each position of a
        packed sample (the whole sequence, also under sequence parallelism); every attention of this call, the top
        query layer's included, then sees only earlier positions of the same document, through one (b, 1, s, s)
        bool mask built here (attention.py says what it costs). None: the plain causal path, unchanged.
        """
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk {chunk}: this stage has {self.num_chunks} model chunk(s)")
        if self.num_chunks > 1 and kv_cache is not None:
            raise ValueError("decoding with a KV cache runs a whole model: build it without chunk_layers")
        pre_process = self.pre_process and chunk == 0
        post_process = self.post_process and chunk == self.num_chunks - 1
        self.config.check_sequence_length(position_ids.shape[-1])
        if kv_cache is None and attention_mask is not None:
            raise ValueError("attention_mask needs kv_cache: padding is supported when decoding only")
        if kv_cache is not None:
            self.groups.check_whole_sequences("decoding with a KV cache")
        if kv_cache is not None and document_ids is not None:
            raise ValueError("document_ids go with training, not kv_cache (decoding masks padding only)")
        if document_ids is not None and document_ids.shape != position_ids.shape:
            raise ValueError(f"document_ids {tuple(document_ids.shape)} and position_ids {tuple(position_ids.shape)}: "
                             f"one (b, s) entry per position, the whole sequence")
        # () or the one mask every attention of this forward reads: document masking's and / or the sliding window's
        # band (under CP the ring masks by the window itself, a KV cache by its own)
        window = self.config.window_size if kv_cache is None and self.groups.cp is None else None
        mask = training_attention_mask(document_ids, position_ids.shape[-1], window, position_ids.device)
        if labels is not None and (kv_cache is not None or last_token_only):
            raise ValueError("labels (the training loss) go with neither kv_cache nor last_token_only")
        if kv_cache is not None:
            kv_cache.begin(position_ids.shape[-1], attention_mask)
        if self.sequence_parallel and kv_cache is not None:
            raise ValueError("decoding with a KV cache splits no sequence: build the model without sequence "
                             "parallelism")
        if pre_process:
            words = self.word_embeddings(inputs)  # (b, s, h) all-reduced over TP; SP: (b, s/tp, h) reduce-scattered
            hidden = words if self.config.rope else words + self.position_embeddings(position_ids)
            # replicated: the default stream; split along the sequence (SP): the per-TP-rank stream
            hidden = sequence_parallel_dropout(hidden, self.config.hidden_dropout, self.training, self.rng_tracker,
                                               self.sequence_parallel)
        else:
            hidden = inputs  # (b, s, h), or (b, s/tp, h) under SP, from the previous stage
        # RoPE: one (2, b, s, 1, r/2) cos / sin table for every attention of this call, the whole sequence's (under
        # SP too: the attention sees all of it), in the activations' dtype
        rotary = rotary_tables(position_ids, self.config.rotary_dim, self.config.rotary_base, hidden.dtype,
                               RopeScaling.of(self.config)) if self.config.rope else None
        if kv_cache is None:
            hidden = self._run_layers(hidden, chunk, mask, rotary)
        else:
            for slot, layer in enumerate(self.layers.values()):
                hidden = layer(hidden, rotary=rotary, cache=kv_cache.slot(slot))
        if not post_process:
            if kv_cache is not None:
                kv_cache.commit()
            return hidden

        hidden = self.final_layernorm(hidden)
        if self.config.top_query_layer:
            # (b, s, h), or (b, s/tp, h) under SP: the row of each position, or under RoPE the one row everywhere
            queries = self.top_query_embeddings(torch.zeros_like(position_ids) if self.config.rope else position_ids)
            if kv_cache is None and self._recompute_top_query and self._recomputing():
                hidden = self._recompute(self.top_query_layer, hidden, queries, *mask, rotary=rotary)
            elif kv_cache is None:
                hidden = self.top_query_layer(hidden, queries, *mask, rotary=rotary)
            else:  # keys/values from the final hidden states, cached like every layer's
                hidden = self.top_query_layer(hidden, queries, rotary=rotary, cache=kv_cache.slot(len(self.layers)))
        if kv_cache is not None:
            kv_cache.commit()
        if last_token_only:
            hidden = hidden[:, -1:]
        logits = parallel_lm_logits(hidden, self.output_weight, self.tp_group,
                                    gather=gather_logits and labels is None,
                                    sequence_parallel=self.sequence_parallel)  # (b, s, v/tp)
        if labels is None:
            return logits
        # The logits are ours alone (nothing in autograd keeps them): the loss overwrites them in place.
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group, inplace=True)  # (b, s)
