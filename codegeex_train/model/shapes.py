"""Every parameter of the whole model and its shape, from the config alone (no model built): what a checkpoint of it
holds, what an import must supply and what an export writes. ``CodeGeeXModel``'s state dict has exactly these names,
in this order (tests check the two agree)."""

from __future__ import annotations

from codegeex_train.config.model_config import ModelConfig


def _norm_shapes(name: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = config.hidden_size
    return {f"{name}.weight": (h,)} | ({} if config.normalization == "RMSNorm" else {f"{name}.bias": (h,)})


def _linear_shapes(name: str, rows: int, columns: int, bias: bool) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (rows, columns)} | ({f"{name}.bias": (rows,)} if bias else {})


def _layer_shapes(prefix: str, config: ModelConfig, attention: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """One layer's parameters in the module's order; ``attention``: the column-parallel projections and their rows."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    shapes = _norm_shapes(f"{prefix}input_layernorm", config)
    for name, rows in attention.items():  # column-parallel projections: (out, in)
        shapes.update(_linear_shapes(f"{prefix}attention.{name}", rows, h, config.qkv_bias))
    shapes.update(_linear_shapes(f"{prefix}attention.dense", h, config.num_attention_heads * config.head_dim,
                                 config.linear_bias))
    shapes.update(_norm_shapes(f"{prefix}post_attention_layernorm", config))
    shapes.update(_linear_shapes(f"{prefix}mlp.dense_h_to_4h", config.mlp_in_size, h, config.linear_bias))
    shapes.update(_linear_shapes(f"{prefix}mlp.dense_4h_to_h", h, ffn, config.linear_bias))
    return shapes


def model_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model (TP = PP = 1) with its shape, in ``CodeGeeXModel``'s order: what its
    ``state_dict`` holds (tests check the two agree), computed without building it."""
    h = config.hidden_size
    shapes = {"word_embeddings.weight": (config.padded_vocab_size, h)}
    if config.position_table_rows:  # learned_absolute
        shapes["position_embeddings.weight"] = (config.position_table_rows, h)
    for i in range(config.num_layers):  # fused [Q; K; V]: the heads' queries, the groups' keys and values
        shapes.update(_layer_shapes(f"layers.{i}.", config, {"query_key_value": h + 2 * config.kv_size}))
    shapes.update(_norm_shapes("final_layernorm", config))
    if config.top_query_layer:
        shapes["top_query_embeddings.weight"] = (config.top_query_rows, h)
        shapes.update(_layer_shapes("top_query_layer.", config, {"query": h, "key_value": 2 * h}))
    if not config.tied_output:
        shapes["output_layer.weight"] = (config.padded_vocab_size, h)
    return shapes
