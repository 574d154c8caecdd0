"""CodeGeeXConfig: the shape of a model trained by codegeex_train, for ``transformers`` (remote code).

Field names follow codegeex_train's ModelConfig (its Megatron flags: ``num_layers`` is --num-layers, the top query
layer not counted) except where ``transformers`` reads a field by its own name (``vocab_size``, ``hidden_size``,
``num_attention_heads``, ``max_position_embeddings``, ``initializer_range``, the token ids). ``vocab_size`` is the
tokenizer's; the trained word table's padding rows are not exported.
"""

from transformers import PreTrainedConfig

ACTIVATIONS = ("gelu", "gelu_tanh", "fast_gelu")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")


class CodeGeeXConfig(PreTrainedConfig):
    """A GPT decoder (pre-LayerNorm, fused QKV, tied word table) with CodeGeeX's optional top query layer."""

    model_type = "codegeex"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = 50400
    hidden_size: int = 256
    num_layers: int = 4
    num_attention_heads: int = 8
    ffn_hidden_size: int | None = None  # None: 4 x hidden_size
    max_position_embeddings: int = 1024
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rotary_interleaved: bool = False
    activation: str = "fast_gelu"
    top_query_layer: bool = True
    layernorm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        kwargs.pop("num_hidden_layers", None)  # derived (below), never stored
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: expected one of {ACTIVATIONS}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r}: expected one of "
                             f"{POSITION_EMBEDDING_TYPES}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        super().__post_init__(**kwargs)

    @property
    def num_hidden_layers(self) -> int:
        """Attentions holding a KV cache: the decoder layers, then the top query layer. ``generate`` sizes its
        ``DynamicCache`` from this, so the top query layer gets cache slot ``num_layers``."""
        return self.num_layers + int(self.top_query_layer)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates: the first int(head_dim x rotary_percent)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def top_query_rows(self) -> int:
        """Rows of the top query table: one per position, or under RoPE one row, rotated by the position."""
        return 1 if self.position_embedding_type == "rope" else self.max_position_embeddings


__all__ = ["CodeGeeXConfig"]
