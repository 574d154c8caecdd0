"""CodeGeeXForCausalLM: a model trained by codegeex_train, for ``transformers`` (remote code).

    model = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)
    model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False)  # its own DynamicCache

The maths is codegeex_train's (model/): pre-LayerNorm GPT layers with a fused [Q; K; V] projection (Q, K, V blocks
of h rows each, heads in order inside a block), positions learned (a table added to the word embeddings) or RoPE
(each head's first rotary_dim channels, pairs (i, i + r/2) or interleaved (2i, 2i + 1)), then the final LayerNorm
and CodeGeeX's optional top query layer: an attention whose keys and values come from the final hidden states and
whose queries come from an embedding of the position (under RoPE one learned row, rotated by the position like the
keys). Its output feeds the tied output layer directly. Parameter names are codegeex_train's under ``transformer.``.

Padding: left padding through ``attention_mask`` (b, past + s) 1 = real token; positions count from each row's
first real token, padding is never attended to (a padding query attends to itself, so no softmax row is empty).
Cache: a ``transformers`` Cache (``generate`` builds a DynamicCache sized by ``config.num_hidden_layers``, which
counts the top query layer); slot i holds layer i's keys and values (b, heads, seq, head_dim), RoPE keys rotated.
Needs transformers >= 5 (its Cache API, the ``cache`` output field and the tied-weights map).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_codegeex import CodeGeeXConfig


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """CodeGeeX's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,  # erf
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's gelu_new
    "fast_gelu": fast_gelu,
}


def rotary_tables(position_ids: torch.Tensor, config: CodeGeeXConfig, dtype: torch.dtype):
    """(b, s) positions -> cos, sin (b, 1, s, rotary_dim / 2) of position x base^(-2i / rotary_dim): angles in fp32,
    cast to the activations' dtype; the 1 broadcasts over heads."""
    r = config.rotary_dim
    inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, r, 2, dtype=torch.float32,
                                                          device=position_ids.device) / r))
    angles = position_ids[:, None, :, None].float() * inv_freq  # (b, 1, s, r/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Turn channel pairs (a, b) of the first rotary_dim channels of each head of x (b, n, s, d) by the tables:
    a' = a cos - b sin, b' = b cos + a sin; the other channels pass through."""
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:  # pairs (2i, 2i + 1), GPT-J's layout
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:  # pairs (i, i + r/2), GPT-NeoX's layout
        a, b = rot[..., : r // 2], rot[..., r // 2:]
        turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((turned, rest), dim=-1)


class CodeGeeXAttention(nn.Module):
    """Multi-head attention over causal (and cached) keys, then the output projection ``dense``; subclasses say
    where q, k, v come from (``project``)."""

    def __init__(self, config: CodeGeeXConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx  # layer_idx: this attention's slot of the cache
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def project(self, x: torch.Tensor, queries: torch.Tensor | None):
        raise NotImplementedError

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rotary, cache: Cache | None,
                queries: torch.Tensor | None = None) -> torch.Tensor:
        """x (b, s, h), mask (b | 1, 1, s, past + s) bool (True: attend) -> (b, s, h)."""
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.config.head_dim).transpose(1, 2)
                   for t in self.project(x, queries))  # (b, n, s, d)
        if rotary is not None:  # keys are cached rotated by their own positions
            q, k = (apply_rotary(t, *rotary, self.config.rotary_interleaved) for t in (q, k))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (b, n, past + s, d)
        p = self.config.attention_dropout if self.training else 0.0
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (b, n, s, d)
        return self.dense(ctx.transpose(1, 2).reshape(b, s, -1))


class CodeGeeXSelfAttention(CodeGeeXAttention):
    """q, k, v from the hidden states through one fused [Q; K; V] projection."""

    def __init__(self, config: CodeGeeXConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def project(self, x: torch.Tensor, queries: torch.Tensor | None):
        return self.query_key_value(x).split(self.config.hidden_size, dim=-1)  # 3 x (b, s, h)


class CodeGeeXTopQueryAttention(CodeGeeXAttention):
    """k, v from the hidden states (fused [K; V]); q from the top query embeddings."""

    def __init__(self, config: CodeGeeXConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key_value = nn.Linear(config.hidden_size, 2 * config.hidden_size)

    def project(self, x: torch.Tensor, queries: torch.Tensor | None):
        k, v = self.key_value(x).split(self.config.hidden_size, dim=-1)  # 2 x (b, s, h)
        return self.query(queries), k, v


class CodeGeeXMLP(nn.Module):
    def __init__(self, config: CodeGeeXConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.activation(self.dense_h_to_4h(x)))


class CodeGeeXLayer(nn.Module):
    """y = x + drop(attn(LN(x))), out = y + drop(mlp(LN(y))); the top query layer passes its query embeddings
    (not normalised) to its attention."""

    def __init__(self, config: CodeGeeXConfig, layer_idx: int, top_query: bool = False):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        attention = CodeGeeXTopQueryAttention if top_query else CodeGeeXSelfAttention
        self.attention = attention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = CodeGeeXMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x, mask, rotary, cache, queries=None) -> torch.Tensor:
        y = x + self.dropout(self.attention(self.input_layernorm(x), mask, rotary, cache, queries))
        return y + self.dropout(self.mlp(self.post_attention_layernorm(y)))


class CodeGeeXPreTrainedModel(PreTrainedModel):
    config_class = CodeGeeXConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["CodeGeeXLayer"]
    supports_gradient_checkpointing = False


class CodeGeeXModel(CodeGeeXPreTrainedModel):
    """Embeddings, the decoder layers, the final LayerNorm and the top query layer: hidden states (b, s, h)."""

    def __init__(self, config: CodeGeeXConfig):
        super().__init__(config)
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.rope = config.position_embedding_type == "rope"
        if not self.rope:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(CodeGeeXLayer(config, i) for i in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        if config.top_query_layer:
            self.top_query_embeddings = nn.Embedding(config.top_query_rows, h)
            self.top_query_layer = CodeGeeXLayer(config, config.num_layers, top_query=True)
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                use_cache: bool | None = None) -> BaseModelOutputWithPast:
        b, s = input_ids.shape
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.shape[-1] != past + s:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions: it must cover the "
                             f"{past} cached and the {s} new ones")
        if position_ids is None:  # from each row's first real token, as generate() computes them
            if attention_mask is None:
                position_ids = torch.arange(past, past + s, device=input_ids.device).expand(b, s)
            else:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
        mask = self._attention_mask(attention_mask, past, s, input_ids.device)

        hidden = self.word_embeddings(input_ids)  # (b, s, h)
        if not self.rope:
            hidden = hidden + self.position_embeddings(position_ids)
        hidden = self.dropout(hidden)
        rotary = rotary_tables(position_ids, self.config, hidden.dtype) if self.rope else None
        for layer in self.layers:
            hidden = layer(hidden, mask, rotary, cache)
        hidden = self.final_layernorm(hidden)
        if self.config.top_query_layer:
            # The row of each position; under RoPE the one row everywhere (the rotation carries the position)
            queries = self.top_query_embeddings(torch.zeros_like(position_ids) if self.rope else position_ids)
            hidden = self.top_query_layer(hidden, mask, rotary, cache, queries)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache if use_cache else None)

    @staticmethod
    def _attention_mask(attention_mask: torch.Tensor | None, past: int, s: int, device) -> torch.Tensor:
        """(b | 1, 1, s, past + s) bool: query i (position past + i) sees real keys j <= past + i, and itself."""
        q_pos = torch.arange(past, past + s, device=device)[:, None]
        k_pos = torch.arange(past + s, device=device)[None, :]
        if attention_mask is None:
            return (k_pos <= q_pos)[None, None]
        allowed = (k_pos <= q_pos) & attention_mask.bool()[:, None, :]  # (b, s, past + s)
        return (allowed | (k_pos == q_pos)).unsqueeze(1)


class CodeGeeXForCausalLM(CodeGeeXPreTrainedModel, GenerationMixin):
    """CodeGeeXModel and the output layer, tied to the word table: logits (b, s, vocab_size)."""

    _tied_weights_keys = {"lm_head.weight": "transformer.word_embeddings.weight"}

    def __init__(self, config: CodeGeeXConfig):
        super().__init__(config)
        self.transformer = CodeGeeXModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.word_embeddings

    def set_input_embeddings(self, value):
        self.transformer.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                past_key_values: Cache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, logits_to_keep: int = 0, return_dict: bool | None = None,
                **kwargs) -> CausalLMOutputWithPast | tuple:
        """``cache`` is transformers 5's name for the KV cache, ``past_key_values`` its older one (either works).
        ``labels`` (b, s): the mean next-token loss over labels != -100 (shifted inside). ``logits_to_keep`` n > 0:
        logits of the last n positions only (``generate`` asks for 1)."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        out = self.transformer(input_ids, attention_mask, position_ids, cache, use_cache)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)  # (b, s, vocab_size)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=kwargs.get("num_items_in_batch"))
        result = CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
        return result if return_dict is not False else result.to_tuple()


__all__ = ["CodeGeeXForCausalLM", "CodeGeeXModel", "CodeGeeXPreTrainedModel"]
