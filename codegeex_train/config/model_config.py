"""The model's shape, as a typed dataclass whose fields are also the Megatron flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from codegeex_train.config.options import UNIT_OPEN, Range, above, at_least, option, out_of_range
from codegeex_train.layout.errors import LayoutError
from codegeex_train.layout.plan import heads_per_tp_rank, kv_groups_per_tp_rank

ACTIVATIONS = ("gelu", "gelu_tanh", "fast_gelu")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


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
    max_position_embeddings: int = option(
        1024, "longest sequence (--seq-length; in generation a prompt plus its completion); with learned_absolute "
        "also the rows of the position table", bounds=at_least(1))
    position_embedding_type: str = option(
        "learned_absolute", "learned_absolute: a learned table added to the word embeddings (CodeGeeX's); rope: "
        "rotary embeddings of each head's queries and keys, no table (model/rotary.py)",
        choices=POSITION_EMBEDDING_TYPES)
    rotary_percent: float = option(1.0, "RoPE: the fraction of each head's channels that rotate (the first "
                                   "int(head dim x percent), an even number)", bounds=Range(0, 1, lo_open=True))
    rotary_base: int = option(10000, "RoPE: channel pair i turns at position x base^(-2i / rotary dim) radians",
                              bounds=above(1))
    rotary_interleaved: bool = option(False, "RoPE: rotate channel pairs (0, 1), (2, 3), ... (GPT-J's layout) "
                                      "instead of (i, i + rotary dim / 2) (GPT-NeoX's, Llama's)")
    rope_scaling: str = option(
        "none", "RoPE scaling as the model families use it (model/rotary.py): linear (positions / factor, "
        "Megatron's --rotary-seq-len-interpolation-factor), llama3 (Llama 3.1's per-frequency scaling), yarn (YaRN: "
        "per-frequency interpolation and an attention temperature)", choices=ROPE_SCALINGS)
    rope_scaling_factor: float = option(1.0, "RoPE scaling: the context extension factor", bounds=above(0))
    rope_original_max_position_embeddings: int | None = option(
        None, "RoPE scaling (llama3, yarn): the context length the model was first trained at", bounds=at_least(1))
    rope_low_freq_factor: float = option(1.0, "llama3 RoPE scaling: wavelengths above original length / this "
                                         "factor are divided by the scaling factor", bounds=above(0))
    rope_high_freq_factor: float = option(4.0, "llama3 RoPE scaling: wavelengths below original length / this "
                                          "factor are kept", bounds=above(0))
    yarn_beta_fast: float = option(32.0, "YaRN: rotations over the original length above which a frequency is "
                                   "kept (extrapolated)", bounds=above(0))
    yarn_beta_slow: float = option(1.0, "YaRN: rotations over the original length below which a frequency is "
                                   "interpolated", bounds=above(0))
    yarn_attention_factor: float | None = option(
        None, "YaRN: the factor cos and sin are scaled by (default 0.1 ln(factor) + 1)", bounds=above(0))
    window_size: int | None = option(
        None, "sliding-window attention (Hugging Face's sliding_window): token i attends to tokens i - W + 1 .. i "
        "only; none: the whole causal prefix", bounds=at_least(1))
    normalization: str = option("LayerNorm", "the norm before attention, before the MLP and after the stack: "
                                "LayerNorm (CodeGeeX's, GPT-2's, StarCoder2's) or RMSNorm (Llama's, Qwen2's; a "
                                "weight and no bias)", choices=NORMALIZATIONS)
    swiglu: bool = option(False, "gated MLP: dense_4h_to_h(silu(x W_gate) * (x W_up)) (Llama's, Qwen2's); "
                          "dense_h_to_4h then holds [gate; up], 2 x --ffn-hidden-size rows; replaces --activation")
    group_query_attention: bool = option(False, "grouped-query attention: --num-query-groups key-value heads, each "
                                         "shared by num-attention-heads / num-query-groups query heads")
    num_query_groups: int | None = option(None, "grouped-query attention: the key-value heads (groups); must divide "
                                          "--num-attention-heads and be divisible by the TP size",
                                          bounds=at_least(1))
    untie_embeddings_and_output_weights: bool = option(
        False, "an output layer with its own weights (output_layer, on the last stage) instead of the word "
        "embeddings (tied: CodeGeeX's, GPT-2's)")
    disable_bias_linear: bool = option(False, "no biases in the attention's and the MLP's linear layers (Llama's)")
    add_qkv_bias: bool = option(False, "with --disable-bias-linear: keep the query, key and value projections' "
                                "biases (Qwen2's)")
    make_vocab_size_divisible_by: int = option(
        128, "pad the tokenizer's vocabulary to a multiple of this (independent of TP, so checkpoints "
        "move between TP sizes); the padded size must divide by the TP size", bounds=at_least(1))
    hidden_dropout: float = option(0.1, "dropout on the residual stream (embeddings, attention and MLP outputs)",
                                   bounds=UNIT_OPEN)
    attention_dropout: float = option(0.1, "dropout on attention probabilities", bounds=UNIT_OPEN)
    layernorm_epsilon: float = option(1e-5, "the norm's epsilon (LayerNorm or RMSNorm)", bounds=above(0),
                                      flags=("--layernorm-epsilon", "--norm-epsilon"))
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

    @property
    def kv_groups(self) -> int:
        """Key-value heads: --num-query-groups under grouped-query attention, else one per attention head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Channels of the keys (and of the values): kv_groups x head_dim."""
        return self.kv_groups * self.head_dim

    @property
    def linear_bias(self) -> bool:
        """The attention's output projection and the MLP's linears have biases."""
        return not self.disable_bias_linear

    @property
    def qkv_bias(self) -> bool:
        """The query, key and value projections have biases."""
        return not self.disable_bias_linear or self.add_qkv_bias

    @property
    def tied_output(self) -> bool:
        """The output layer is the word table (tied) rather than output_layer.weight."""
        return not self.untie_embeddings_and_output_weights

    @property
    def mlp_in_size(self) -> int:
        """Rows of dense_h_to_4h: [gate; up] under --swiglu, else the FFN size."""
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (Megatron's int(kv_channels x rotary_percent))."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def position_table_rows(self) -> int:
        """Rows of the learned position table (``position_embeddings``): none under RoPE."""
        return 0 if self.rope else self.max_position_embeddings

    @property
    def top_query_rows(self) -> int:
        """Rows of the top query layer's query table: one per position, or under RoPE one row in all (the
        position enters through the rotation; model/rotary.py says why)."""
        return 1 if self.rope else self.max_position_embeddings

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
        try:
            heads_per_tp_rank(self.num_attention_heads, tp_size)
            kv_groups_per_tp_rank(self.num_attention_heads, self.kv_groups, tp_size)
        except LayoutError as e:
            raise ModelConfigError(str(e)) from None
        if self.ffn_hidden_size % tp_size:
            raise ModelConfigError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                                   f"--tensor-model-parallel-size {tp_size}")
        if self.padded_vocab_size % tp_size:
            raise ModelConfigError(
                f"padded vocabulary {self.padded_vocab_size} (vocab {self.vocab_size} rounded up to "
                f"--make-vocab-size-divisible-by {self.make_vocab_size_divisible_by}) is not divisible by "
                f"--tensor-model-parallel-size {tp_size}: use a multiple of {tp_size} for that flag")
        self.check_rotary()

    def check_architecture(self) -> None:
        """The architecture switches that need one another (callable early: no vocabulary, no TP size)."""
        if self.group_query_attention and self.num_query_groups is None:
            raise ModelConfigError("--group-query-attention needs --num-query-groups N (the key-value heads)")
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ModelConfigError(f"--num-query-groups {self.num_query_groups} needs --group-query-attention")
        if self.add_qkv_bias and not self.disable_bias_linear:
            raise ModelConfigError("--add-qkv-bias goes with --disable-bias-linear (without it every linear layer "
                                   "has a bias already)")
        if self.rope_scaling != "none" and not self.rope:
            raise ModelConfigError(f"--rope-scaling {self.rope_scaling} scales rotary positions: it needs "
                                   f"--position-embedding-type rope")
        if self.rope_scaling in ("llama3", "yarn") and self.rope_original_max_position_embeddings is None:
            raise ModelConfigError(f"--rope-scaling {self.rope_scaling} needs --rope-original-max-position-embeddings "
                                   f"(the length the model was first trained at)")
        if self.rope_scaling == "llama3" and self.rope_low_freq_factor >= self.rope_high_freq_factor:
            raise ModelConfigError(f"--rope-low-freq-factor {self.rope_low_freq_factor} must be below "
                                   f"--rope-high-freq-factor {self.rope_high_freq_factor}")
        if self.swiglu and self.activation != "gelu":
            raise ModelConfigError(f"--swiglu replaces --activation {self.activation}: drop one of them")

    def check_rotary(self) -> None:
        """Under RoPE, that --rotary-percent rotates whole channel pairs (needs no vocabulary: callable early; a head
        count that does not divide the hidden size is ``validate``'s to report)."""
        whole_heads = self.hidden_size % self.num_attention_heads == 0
        if self.rope and whole_heads and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ModelConfigError(
                f"--rotary-percent {self.rotary_percent} rotates int({self.head_dim} x {self.rotary_percent}) = "
                f"{self.rotary_dim} channels of each {self.head_dim}-channel head: RoPE turns channel pairs, so it "
                f"must be an even number >= 2; pick a percent that gives one")

    def check_sequence_length(self, seq_length: int) -> None:
        if seq_length > self.max_position_embeddings:
            raise ModelConfigError(f"sequence length {seq_length} (--seq-length) exceeds --max-position-embeddings "
                                   f"{self.max_position_embeddings}")
