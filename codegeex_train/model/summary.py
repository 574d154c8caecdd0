"""Parameter counts and weight memory, printed once when the model is built."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from codegeex_train.config.model_config import ModelConfig


def _layer_parameters(h: int, ffn: int) -> int:
    layer_norms = 2 * 2 * h
    attention = (3 * h * h + 3 * h) + (h * h + h)  # QKV (or query + KV) and the output projection
    mlp = (h * ffn + ffn) + (ffn * h + h)
    return layer_norms + attention + mlp


def count_parameters(config: ModelConfig) -> int:
    """Parameters of the whole model (all TP ranks and stages, the tied embedding counted once)."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    total = config.padded_vocab_size * h + config.position_table_rows * h  # words, positions (none: RoPE)
    total += config.num_layers * _layer_parameters(h, ffn) + 2 * h  # layers, final LayerNorm
    if config.top_query_layer:
        total += config.top_query_rows * h + _layer_parameters(h, ffn)  # query table (one row: RoPE), top layer
    return total


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


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
            f"{config.hidden_size}, {config.num_attention_heads} heads, ffn {config.ffn_hidden_size}, vocab "
            f"{config.vocab_size} padded to {config.padded_vocab_size}\n"
            f"parameters: {total:,} total ({total / 1e6:.2f} M); this rank (TP {tp_size} x PP {pp_size}): "
            f"{local:,}; weights on this rank: {memory} (sum {_fmt_bytes(sum(by_dtype.values()))})")
