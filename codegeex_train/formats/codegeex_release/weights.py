"""The released CodeGeeX checkpoint layout <-> our full (TP=1) state dict. Pure functions, exact both ways.

The released CodeGeeX-13B file (and what ``codegeex.megatron``'s ``merge_ckpt_parallel.py`` /
``mindspore_to_megatron.py`` write) is ``torch.save({"module": model.state_dict_for_save_checkpoint()})`` of
the original PyTorch ``CodeGeeXModel`` (package ``codegeex`` 1.0, ``codegeex/torch/codegeex_model.py``), fp16::

    {"module": {"language_model": {
        "embedding": {"word_embeddings": {"weight": (V, h)}, "position_embeddings": {"weight": (P, h)}},
        "topQueryEmbedding": {"top_query_embeddings": {"weight": (P, h)}},
        "transformer": {"layers.0.input_layernorm.weight": ..., ..., "topQueryLayer. ...": ...,
                        "final_layernorm.weight": ..., "final_layernorm.bias": ...}}}}

``codegeex.torch.CodeGeeXModel.load_state_dict`` reads exactly that ``"module"`` entry. Flattened with dots
it is that model's ``state_dict()`` (``language_model.embedding.word_embeddings.weight``, ...): the "flat
CodeGeeX state dict" below. The name mapping (theirs ``language_model.`` + ..., ours):

======================================================================  =============================================
``embedding.word_embeddings.weight``  (padded vocab rows, all kept)      ``word_embeddings.weight``
``embedding.position_embeddings.weight``                                 ``position_embeddings.weight``
``transformer.layers.{i}.input_layernorm.{weight,bias}``                 ``layers.{i}.input_layernorm.*``
``transformer.layers.{i}.attention.{query,key,value}.{weight,bias}``     ``layers.{i}.attention.query_key_value.*``
                                                                         = cat([Q; K; V], dim 0)
``transformer.layers.{i}.attention.dense.*``, ``post_attention_layernorm.*``, ``mlp.dense_h_to_4h.*``,
``mlp.dense_4h_to_h.*``                                                  the same names under ``layers.{i}.``
``transformer.final_layernorm.*``                                        ``final_layernorm.*``
``topQueryEmbedding.top_query_embeddings.weight``                        ``top_query_embeddings.weight``
``transformer.topQueryLayer.attention.query.*``                          ``top_query_layer.attention.query.*``
``transformer.topQueryLayer.attention.{key,value}.*``                    ``top_query_layer.attention.key_value.*``
                                                                         = cat([K; V], dim 0)
``transformer.topQueryLayer.<rest>``                                     ``top_query_layer.<rest>``
======================================================================  =============================================

Both use ``nn.Linear``'s (out, in) weights and split each of Q, K, V into heads the same way (``view(...,
heads, head_dim)`` of the h outputs), so fusing is a plain concatenation: our TP partition then gives rank r
the rows of its heads from each block (stride 3, resp. 2 for K/V). Values and dtypes are never changed: a
fused tensor is the concatenation of its parts, and splitting it back gives them bit for bit (fp16 stays fp16).

What the layout does not say and the config must: the number of attention heads. The rest is read off the
shapes (layers, hidden, MLP width, positions, padded vocabulary). The model is CodeGeeX's: the top query layer,
fast_gelu (``x * sigmoid(1.702 x)``; the package writes it as ``x / (1 + exp(-1.702|x|)) * exp(0.851 (x -
|x|))``, the same function), LayerNorm epsilon 1e-5, pre-LN layers, final LayerNorm before the top query
layer, logits against the word table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.config.model_config import ModelConfig

PREFIX = "language_model."
WORDS = PREFIX + "embedding.word_embeddings.weight"
POSITIONS = PREFIX + "embedding.position_embeddings.weight"
TOP_QUERIES = PREFIX + "topQueryEmbedding.top_query_embeddings.weight"
TRANSFORMER = PREFIX + "transformer."
# The codegeex package's CodeGeeXModel hard-codes these (TransformerLayer, MLP, Transformer defaults).
CODEGEEX_LAYERNORM_EPSILON = 1e-5
CODEGEEX_ACTIVATION = "fast_gelu"

# One layer, in the codegeex model's parameter order: (our name, their names). Several names of theirs are
# concatenated along dim 0 into one of ours. Regular layers fuse Q, K, V; the top query layer fuses K, V.


def _layer_table(top: bool) -> list[tuple[str, tuple[str, ...]]]:
    table = [(f"input_layernorm.{p}", (f"input_layernorm.{p}",)) for p in ("weight", "bias")]
    if top:
        table += [(f"attention.query.{p}", (f"attention.query.{p}",)) for p in ("weight", "bias")]
        table += [(f"attention.key_value.{p}", (f"attention.key.{p}", f"attention.value.{p}"))
                  for p in ("weight", "bias")]
    else:
        table += [(f"attention.query_key_value.{p}", (f"attention.query.{p}", f"attention.key.{p}",
                                                      f"attention.value.{p}")) for p in ("weight", "bias")]
    for module in ("attention.dense", "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
        table += [(f"{module}.{p}", (f"{module}.{p}",)) for p in ("weight", "bias")]
    return table


def _their_layer_names(top: bool) -> list[str]:
    """One layer's parameter names in the codegeex model's order (query, key, value each weight then bias)."""
    names = [f"input_layernorm.{p}" for p in ("weight", "bias")]
    names += [f"attention.{m}.{p}" for m in ("query", "key", "value", "dense") for p in ("weight", "bias")]
    names += [f"{m}.{p}" for m in ("post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
              for p in ("weight", "bias")]
    return names


def _layer_prefixes(num_layers: int) -> list[tuple[str, str, bool]]:
    """(our prefix, their prefix, is the top query layer) for every layer, in order."""
    out = [(f"layers.{i}.", f"{TRANSFORMER}layers.{i}.", False) for i in range(num_layers)]
    return out + [("top_query_layer.", f"{TRANSFORMER}topQueryLayer.", True)]


def codegeex_names(num_layers: int) -> list[str]:
    """The flat parameter names of ``codegeex.torch.CodeGeeXModel`` with ``num_layers`` layers, in its order."""
    names = [WORDS, POSITIONS, TOP_QUERIES]
    for _, theirs, top in _layer_prefixes(num_layers):
        names += [theirs + n for n in _their_layer_names(top)]
    return names + [f"{TRANSFORMER}final_layernorm.weight", f"{TRANSFORMER}final_layernorm.bias"]


def codegeex_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The flat names of ``codegeex_names`` with the shapes ``config`` implies (each fused tensor of ours split into
    its equal blocks: Q, K, V each (h, h))."""
    ours = model_parameter_shapes(config)
    shapes = {WORDS: ours["word_embeddings.weight"], POSITIONS: ours["position_embeddings.weight"],
              TOP_QUERIES: ours["top_query_embeddings.weight"]}
    for our_prefix, their_prefix, top in _layer_prefixes(config.num_layers):
        for our_name, their_names in _layer_table(top):
            rows, *rest = ours[our_prefix + our_name]
            shapes.update({their_prefix + n: (rows // len(their_names), *rest) for n in their_names})
    for p in ("weight", "bias"):
        shapes[f"{TRANSFORMER}final_layernorm.{p}"] = ours[f"final_layernorm.{p}"]
    return shapes


# --- The file's nesting ----------------------------------------------------------------------------------

def _flatten(tree: Mapping, prefix: str, out: dict[str, torch.Tensor]) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, name + ".", out)
        elif isinstance(value, torch.Tensor):
            out[name] = value
        else:
            raise ValueError(f"entry {name!r} is a {type(value).__name__}, not a tensor or a dict of them")


def codegeex_state_dict(checkpoint: object) -> dict[str, torch.Tensor]:
    """The flat CodeGeeX state dict of a loaded CodeGeeX checkpoint: ``{"module": {"language_model": ...}}``
    (the released file; other top-level entries are ignored), its ``"module"`` alone, or an already flat
    ``CodeGeeXModel.state_dict()``. Raises ValueError saying what was found instead."""
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"holds a {type(checkpoint).__name__}, not a CodeGeeX checkpoint dict")
    tree = checkpoint.get("module", checkpoint)
    if not isinstance(tree, Mapping) or not any(str(k).split(".")[0] == "language_model" for k in tree):
        raise ValueError(f"not a CodeGeeX checkpoint: expected {{'module': {{'language_model': ...}}}} (the "
                         f"layout of the released CodeGeeX-13B file), found top-level keys "
                         f"{sorted(map(str, checkpoint))[:8]}")
    flat: dict[str, torch.Tensor] = {}
    _flatten(tree, "", flat)
    return flat


def codegeex_checkpoint(flat: Mapping[str, torch.Tensor]) -> dict:
    """Inverse of :func:`codegeex_state_dict` for the released layout: ``{"module": nested}``, nested as
    ``CodeGeeXModel.state_dict_for_save_checkpoint()`` nests it (the transformer's names stay flat)."""
    language_model: dict = {}
    for name, tensor in flat.items():
        if not name.startswith(PREFIX):
            raise ValueError(f"{name!r} is not a CodeGeeX parameter name (they start with {PREFIX!r})")
        rest = name[len(PREFIX):]
        if rest.startswith("transformer."):
            path = ["transformer", rest[len("transformer."):]]
        else:  # embedding.word_embeddings.weight -> embedding / word_embeddings / weight
            path = rest.split(".")
        node = language_model
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tensor
    return {"module": {"language_model": language_model}}


# --- Config -----------------------------------------------------------------------------------------------

_LAYER_INDEX = re.compile(re.escape(TRANSFORMER) + r"layers\.(\d+)\.")


def _require(flat: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in flat:
        raise ValueError(f"no {name!r}: not a complete CodeGeeX state dict")
    return flat[name]


def config_from_codegeex(flat: Mapping[str, torch.Tensor], num_attention_heads: int, **overrides) -> ModelConfig:
    """Our ModelConfig for a flat CodeGeeX state dict: shapes from the tensors, the head count from the caller
    (the weights do not say it; CodeGeeX-13B has 40). The padded vocabulary is the word table's row count
    (CodeGeeX-13B: 52,224): ``vocab_size`` and ``make_vocab_size_divisible_by`` are both set to it, so that
    ``padded_vocab_size`` is exactly that. ``overrides``: other ModelConfig fields (dropout, init std)."""
    words = _require(flat, WORDS)
    if words.dim() != 2:
        raise ValueError(f"{WORDS} has shape {tuple(words.shape)}: not a (vocabulary, hidden) table")
    layers = sorted({int(m.group(1)) for n in flat if (m := _LAYER_INDEX.match(n))})
    if layers != list(range(len(layers))):
        raise ValueError(f"layer numbers {layers} are not 0..{len(layers) - 1}")
    rows, hidden = words.shape
    positions = _require(flat, POSITIONS).shape[0]
    if _require(flat, TOP_QUERIES).shape[0] != positions:
        raise ValueError(f"{TOP_QUERIES} has {flat[TOP_QUERIES].shape[0]} rows but {POSITIONS} {positions}: our "
                         f"model uses one --max-position-embeddings for both")
    ffn = _require(flat, f"{TRANSFORMER}topQueryLayer.mlp.dense_h_to_4h.weight").shape[0]
    fields = dict(num_layers=len(layers), hidden_size=hidden, num_attention_heads=num_attention_heads,
                  ffn_hidden_size=ffn, max_position_embeddings=positions, make_vocab_size_divisible_by=rows,
                  vocab_size=rows, layernorm_epsilon=CODEGEEX_LAYERNORM_EPSILON, activation=CODEGEEX_ACTIVATION,
                  top_query_layer=True)
    fields.update(overrides)
    config = ModelConfig(**fields)
    config.validate()
    return config


def check_codegeex_config(config: ModelConfig) -> None:
    """ValueError unless ``config`` is a model the codegeex package's CodeGeeXModel can hold."""
    problems = []
    if config.rope:
        problems.append("--position-embedding-type rope (CodeGeeX: learned positions)")
    if not config.top_query_layer:
        problems.append("no top query layer (--no-top-query-layer)")
    if config.activation != CODEGEEX_ACTIVATION:
        problems.append(f"--activation {config.activation} (CodeGeeX: {CODEGEEX_ACTIVATION})")
    if config.ffn_hidden_size != 4 * config.hidden_size:
        problems.append(f"--ffn-hidden-size {config.ffn_hidden_size} (CodeGeeX: 4 x hidden = {4 * config.hidden_size})")
    if config.layernorm_epsilon != CODEGEEX_LAYERNORM_EPSILON:
        problems.append(f"--layernorm-epsilon {config.layernorm_epsilon} (CodeGeeX: {CODEGEEX_LAYERNORM_EPSILON})")
    if problems:
        raise ValueError(f"not a CodeGeeX model, so the codegeex package could not load it: {'; '.join(problems)}")


# --- The mapping ------------------------------------------------------------------------------------------

def _cat(parts: list[torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if len({(p.dtype, p.shape[1:]) for p in parts}) != 1:
        raise ValueError(f"{', '.join(names)} differ in dtype or shape "
                         f"({', '.join(f'{p.dtype} {tuple(p.shape)}' for p in parts)}): cannot fuse them")
    return torch.cat(parts, dim=0)


def codegeex_to_full(flat: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A flat CodeGeeX state dict -> our TP=1 state dict (our model's parameter order). Q/K/V (top query
    layer: K/V) are concatenated into new tensors; every other tensor is passed through (shared, not copied).
    The names must be exactly the codegeex model's for ``config.num_layers`` layers."""
    expected = codegeex_names(config.num_layers)
    if set(flat) != set(expected):
        missing, unknown = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
        raise ValueError(f"not the state dict of a {config.num_layers}-layer CodeGeeX model: "
                         f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
                         f"unexpected {unknown[:6]}{' ...' if len(unknown) > 6 else ''}")
    words = flat[WORDS]
    if words.shape != (config.padded_vocab_size, config.hidden_size):
        raise ValueError(f"{WORDS} is {tuple(words.shape)}, but the model's padded vocabulary is "
                         f"{config.padded_vocab_size} x hidden {config.hidden_size}")
    full = {"word_embeddings.weight": words, "position_embeddings.weight": flat[POSITIONS]}
    for ours, theirs, top in _layer_prefixes(config.num_layers):
        if top:
            full["final_layernorm.weight"] = flat[f"{TRANSFORMER}final_layernorm.weight"]
            full["final_layernorm.bias"] = flat[f"{TRANSFORMER}final_layernorm.bias"]
            full["top_query_embeddings.weight"] = flat[TOP_QUERIES]
        for our_name, their_names in _layer_table(top):
            names = tuple(theirs + n for n in their_names)
            full[ours + our_name] = _cat([flat[n] for n in names], names)
    return {k: v.detach() for k, v in full.items()}


def full_to_codegeex(full: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our TP=1 state dict -> the flat CodeGeeX state dict, in the codegeex model's parameter order, each
    tensor its own contiguous copy (fused ones split back into Q, K, V). Inverse of :func:`codegeex_to_full`."""
    check_codegeex_config(config)
    flat: dict[str, torch.Tensor] = {WORDS: full["word_embeddings.weight"],
                                     POSITIONS: full["position_embeddings.weight"],
                                     TOP_QUERIES: full["top_query_embeddings.weight"],
                                     f"{TRANSFORMER}final_layernorm.weight": full["final_layernorm.weight"],
                                     f"{TRANSFORMER}final_layernorm.bias": full["final_layernorm.bias"]}
    for ours, theirs, top in _layer_prefixes(config.num_layers):
        for our_name, their_names in _layer_table(top):
            tensor = full[ours + our_name]
            if tensor.shape[0] % len(their_names):
                raise ValueError(f"{ours + our_name} has {tensor.shape[0]} rows: not {len(their_names)} blocks")
            for name, part in zip(their_names, tensor.chunk(len(their_names), dim=0)):
                flat[theirs + name] = part
    return {name: flat[name].detach().clone().contiguous() for name in codegeex_names(config.num_layers)}
