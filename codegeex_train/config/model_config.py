"""The model's shape, as a typed dataclass whose fields are also the Megatron flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from codegeex_train.config.options import UNIT_OPEN, above, at_least, option, out_of_range

ACTIVATIONS = ("gelu", "gelu_tanh", "fast_gelu")


class ModelConfigError(ValueError):
    """A model shape that cannot work; the message names the flag."""


@dataclass
class ModelConfig:
    """Model: the GPT decoder shape, CodeGeeX's top query layer and initialisation."""

    num_layers: int = option(4, "number of transformer layers (the top query layer not included)", bounds=at_least(1))
    hidden_size: int = option(256, "transformer hidden size h", bounds=at_least(1))
    num_attention_heads: int = option(8, "number of attention heads; must divide by the TP size",
                                      bounds=at_least(1))
    ffn_hidden_size: int | None = option(None, "MLP inner size (default 4 * hidden size)", bounds=at_least(1))
    max_position_embeddings: int = option(1024, "number of learned absolute positions (longest sequence)",
                                          bounds=at_least(1))
    make_vocab_size_divisible_by: int = option(
        128, "pad the tokenizer's vocabulary to a multiple of this (independent of TP, so checkpoints "
        "move between TP sizes); the padded size must divide by the TP size", bounds=at_least(1))
    hidden_dropout: float = option(0.1, "dropout on the residual stream (embeddings, attention and MLP outputs)",
                                   bounds=UNIT_OPEN)
    attention_dropout: float = option(0.1, "dropout on attention probabilities", bounds=UNIT_OPEN)
    layernorm_epsilon: float = option(1e-5, "LayerNorm epsilon", bounds=above(0))
    activation: str = option("gelu", "MLP activation: gelu (erf), gelu_tanh, or fast_gelu = x * sigmoid(1.702 x) "
                             "(CodeGeeX's)", choices=ACTIVATIONS)
    top_query_layer: bool = option(True, "CodeGeeX's top query layer after the decoder stack")
    init_method_std: float = option(0.02, "std of the normal initialisation of weights", bounds=above(0))
    vocab_size: int = 0  # the tokenizer's; set from the tokenizer, not a flag

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

    def with_vocab(self, vocab_size: int) -> "ModelConfig":
        """A copy with the tokenizer's vocabulary (the parsed flags stay as they are)."""
        return replace(self, vocab_size=vocab_size)

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return math.ceil(self.vocab_size / multiple) * multiple

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self, tp_size: int = 1) -> None:
        """Raise ModelConfigError naming the flag; call before any process group or collective."""
        problems = out_of_range(self)  # each field's declared range (the command line checks the same first)
        if problems:
            raise ModelConfigError("; ".join(problems))
        if self.vocab_size < 1:
            raise ModelConfigError("vocab_size is unset: it comes from the tokenizer")
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                                   f"{self.num_attention_heads}")
        if self.num_attention_heads % tp_size:
            raise ModelConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                                   f"--tensor-model-parallel-size {tp_size}: TP splits attention by heads")
        if self.ffn_hidden_size % tp_size:
            raise ModelConfigError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                                   f"--tensor-model-parallel-size {tp_size}")
        if self.padded_vocab_size % tp_size:
            raise ModelConfigError(
                f"padded vocabulary {self.padded_vocab_size} (vocab {self.vocab_size} rounded up to "
                f"--make-vocab-size-divisible-by {self.make_vocab_size_divisible_by}) is not divisible by "
                f"--tensor-model-parallel-size {tp_size}: use a multiple of {tp_size} for that flag")

    def check_sequence_length(self, seq_length: int) -> None:
        if seq_length > self.max_position_embeddings:
            raise ModelConfigError(f"sequence length {seq_length} (--seq-length) exceeds --max-position-embeddings "
                                   f"{self.max_position_embeddings}")
