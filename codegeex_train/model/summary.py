"""Parameter counts and weight memory, printed once when the model is built."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from codegeex_train.config.model_config import ModelConfig


def _norm_parameters(config: ModelConfig) -> int:
    return config.hidden_size * (1 if config.normalization == "RMSNorm" else 2)  # weight (and LayerNorm's bias)


def _linear_parameters(rows: int, columns: int, bias: bool) -> int:
    return rows * columns + (rows if bias else 0)


def _layer_parameters(config: ModelConfig, qkv_rows: int) -> int:
    """One layer: two norms, the attention (``qkv_rows``: its fused projections' rows) and the MLP."""
    h = config.hidden_size
    attention = _linear_parameters(qkv_rows, h, config.qkv_bias) + _linear_parameters(h, h, config.linear_bias)
    mlp = (_linear_parameters(config.mlp_in_size, h, config.linear_bias)
           + _linear_parameters(h, config.ffn_hidden_size, config.linear_bias))
    return 2 * _norm_parameters(config) + attention + mlp


def count_parameters(config: ModelConfig) -> int:
    """Parameters of the whole model (all TP ranks and stages, the tied embedding counted once)."""
    h = config.hidden_size
    total = config.padded_vocab_size * h + config.position_table_rows * h  # words, positions (none: RoPE)
    # layers (the queries of every head, the keys and values of every group), the final norm
    total += config.num_layers * _layer_parameters(config, h + 2 * config.kv_size) + _norm_parameters(config)
    if config.top_query_layer:  # query table (one row: RoPE), top layer (multi-head: query h, key_value 2 h)
        total += config.top_query_rows * h + _layer_parameters(config, 3 * h)
    if not config.tied_output:
        total += config.padded_vocab_size * h  # output_layer
    return total


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


def _architecture(config: ModelConfig) -> str:
    """The architecture switches that differ from CodeGeeX's (empty for it)."""
    parts = [config.normalization] if config.normalization != "LayerNorm" else []
    parts += ["SwiGLU"] if config.swiglu else []
    parts += [f"{config.kv_groups} key-value groups"] if config.group_query_attention else []
    parts += ["untied output layer"] if not config.tied_output else []
    parts += [("QKV biases only" if config.qkv_bias else "no linear biases")] if not config.linear_bias else []
    return "".join(", " + p for p in parts)


def model_summary(model: nn.Module, config: ModelConfig, tp_size: int, pp_size: int = 1) -> str:
    """Total parameters of the full model, and this rank's parameters and weight memory by dtype."""
    by_dtype: dict[str, int] = defaultdict(int)
    local = 0
    for p in model.parameters():
        local += p.numel()
        by_dtype[str(p.dtype).removeprefix("torch.")] += p.numel() * p.element_size()
    memory = ", ".join(f"{d} {_fmt_bytes(b)}" for d, b in sorted(by_dtype.items()))
    total = count_parameters(config)
    return (f"model: {config.num_layers} layers (+{int(config.top_query_layer)} top query), hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, ffn {config.ffn_hidden_size}"
            f"{_architecture(config)}, vocab "
            f"{config.vocab_size} padded to {config.padded_vocab_size}\n"
            f"parameters: {total:,} total ({total / 1e6:.2f} M); this rank (TP {tp_size} x PP {pp_size}): "
            f"{local:,}; weights on this rank: {memory} (sum {_fmt_bytes(sum(by_dtype.values()))})")
