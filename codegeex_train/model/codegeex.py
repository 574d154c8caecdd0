"""CodeGeeXModel: one pipeline stage of the GPT decoder with CodeGeeX's top query layer.

    model = CodeGeeXModel(config, topology.tp_group, tracker, seed=1234)
    logits_shard = model(input_ids, position_ids)                   # (b, s, v/tp)
    loss = model(input_ids, position_ids, labels=labels)            # (b, s) per-token loss, fp32
    logits = model(input_ids, position_ids, gather_logits=True)     # (b, s, v)
    cache = model.new_kv_cache(batch_size, capacity)                # incremental decoding (generation/):
    logits = model(prompt_ids, position_ids, kv_cache=cache, attention_mask=real_tokens)  # fills the cache,
    logits = model(next_ids, next_position_ids, kv_cache=cache)     # then one (b, 1) step at a time

A stage without ``pre_process`` takes hidden states (b, s, h) instead of ids; one without
``post_process`` returns hidden states. Position ids are always passed: the last stage's top query layer
looks its queries up by position. Parameter names use global layer numbers (``layers.7.mlp...``), so a
stage's state dict keys and initial values do not depend on how the layers are split.
"""

from __future__ import annotations

import torch
from torch import nn

from codegeex_train.config.model import ModelConfig
from codegeex_train.model.attention import KVCache
from codegeex_train.model.embedding import ReplicatedEmbedding, parallel_lm_logits, word_embeddings
from codegeex_train.model.init import ParamInit
from codegeex_train.model.transformer import ParallelTransformerLayer, TopQueryLayer, layer_norm
from codegeex_train.tensor_parallel import RNGStatesTracker, checkpoint, vocab_parallel_cross_entropy
from codegeex_train.tensor_parallel.mappings import ProcessGroup, group_rank, group_size


class CodeGeeXModel(nn.Module):
    """One pipeline stage (by default the whole model) of CodeGeeX; see the module docstring."""

    def __init__(self, config: ModelConfig, tp_group: ProcessGroup | None, rng_tracker: RNGStatesTracker | None, *,
                 seed: int = 1234, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: range | None = None, checkpoint_activations: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        config.validate(group_size(tp_group))  # a bad shape fails here, before any weight or collective
        self.config, self.tp_group, self.rng_tracker = config, tp_group, rng_tracker
        self.pre_process, self.post_process = pre_process, post_process
        self.checkpoint_activations = checkpoint_activations
        self.layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        if self.layer_numbers and (self.layer_numbers[0] < 0 or self.layer_numbers[-1] >= config.num_layers):
            raise ValueError(f"layer_numbers {self.layer_numbers} outside 0..{config.num_layers - 1} (--num-layers)")
        init = ParamInit(seed, config.init_method_std, config.num_layers)
        h, kw = config.hidden_size, {"dtype": dtype, "device": device}

        if pre_process or post_process:
            self.word_embeddings = word_embeddings(config.padded_vocab_size, h, tp_group, init, **kw)
        if pre_process:
            self.position_embeddings = ReplicatedEmbedding(config.max_position_embeddings, h, init,
                                                           "position_embeddings.weight", **kw)
        # Keys are global layer numbers: the names (and so the init seeds) are the same at every PP split.
        self.layers = nn.ModuleDict({
            str(i): ParallelTransformerLayer(config, tp_group, rng_tracker, init, f"layers.{i}.", **kw)
            for i in self.layer_numbers
        })
        if post_process:
            self.final_layernorm = layer_norm(config, dtype, device)
            if config.top_query_layer:
                self.top_query_embeddings = ReplicatedEmbedding(config.max_position_embeddings, h, init,
                                                                "top_query_embeddings.weight", **kw)
                self.top_query_layer = TopQueryLayer(config, tp_group, rng_tracker, init, "top_query_layer.", **kw)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp_group)

    def _run(self, fn, *tensors: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and self.training and torch.is_grad_enabled():
            return checkpoint(fn, self.rng_tracker, *tensors)  # restores both RNG streams on recompute
        return fn(*tensors)

    def new_kv_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty KVCache for this stage's attentions (its layers, then the top query layer), this rank's heads,
        ``capacity`` positions (prompt + new tokens), in the dtype and on the device of the weights."""
        weight = next(self.parameters())
        attentions = len(self.layers) + int(self.post_process and self.config.top_query_layer)
        return KVCache(attentions, batch_size, capacity, self.config.num_attention_heads // self.tp_size,
                       self.config.head_dim, dtype=weight.dtype, device=weight.device)

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                gather_logits: bool = False, kv_cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None, last_token_only: bool = False) -> torch.Tensor:
        """``inputs``: token ids (b, s) on the first stage, hidden states (b, s, h) elsewhere.

        Returns hidden states (b, s, h) unless ``post_process``; then the per-token loss (b, s) fp32
        when ``labels`` are given (vocab-parallel, logits never gathered), else the logits shard
        (b, s, v/tp), or the full logits (b, s, v) with ``gather_logits``.

        Decoding: with ``kv_cache`` the inputs are the s positions after those already cached (their keys
        and values are appended, every attention reads the cached ones); ``attention_mask`` (b, s) bool
        marks real tokens (False: padding, never attended to). ``last_token_only`` computes the logits
        of the last position only (b, 1, ...), the one a decoding step samples from.
        """
        self.config.check_sequence_length(position_ids.shape[-1])
        if kv_cache is None and attention_mask is not None:
            raise ValueError("attention_mask needs kv_cache: padding is supported when decoding only")
        if labels is not None and (kv_cache is not None or last_token_only):
            raise ValueError("labels (the training loss) go with neither kv_cache nor last_token_only")
        if kv_cache is not None:
            kv_cache.begin(position_ids.shape[-1], attention_mask)
        if self.pre_process:
            words = self.word_embeddings(inputs)  # (b, s, h), all-reduced over TP
            hidden = words + self.position_embeddings(position_ids)
            hidden = nn.functional.dropout(hidden, self.config.hidden_dropout, self.training)  # replicated: default RNG
        else:
            hidden = inputs  # (b, s, h) from the previous stage
        for slot, layer in enumerate(self.layers.values()):
            hidden = self._run(layer, hidden) if kv_cache is None else layer(hidden, cache=kv_cache.slot(slot))
        if not self.post_process:
            if kv_cache is not None:
                kv_cache.commit()
            return hidden

        hidden = self.final_layernorm(hidden)
        if self.config.top_query_layer:
            queries = self.top_query_embeddings(position_ids)  # (b, s, h)
            if kv_cache is None:
                hidden = self._run(self.top_query_layer, hidden, queries)
            else:  # keys/values from the final hidden states, cached like every layer's
                hidden = self.top_query_layer(hidden, queries, cache=kv_cache.slot(len(self.layers)))
        if kv_cache is not None:
            kv_cache.commit()
        if last_token_only:
            hidden = hidden[:, -1:]
        logits = parallel_lm_logits(hidden, self.word_embeddings.weight, self.tp_group,
                                    gather=gather_logits and labels is None)  # (b, s, v/tp)
        if labels is None:
            return logits
        # The logits are ours alone (nothing in autograd keeps them): the loss overwrites them in place.
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group, inplace=True)  # (b, s)
