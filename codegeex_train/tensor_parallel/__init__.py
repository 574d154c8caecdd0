"""Hand-written Megatron tensor parallelism: f/g communication (mappings.py), the parallel layers (layers.py), the
vocab-parallel loss (cross_entropy.py), and the TP-aware RNG tracker and activation checkpointing (random.py).

May import nothing else of codegeex_train: each layer receives the process group it uses."""

from codegeex_train.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from codegeex_train.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    init_normal,
    set_tensor_model_parallel_attributes,
    shard_master_weight,
)
from codegeex_train.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from codegeex_train.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, checkpoint, model_parallel_seed

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "RNGStatesTracker",
    "model_parallel_seed",
    "checkpoint",
    "MODEL_PARALLEL_RNG",
    "init_normal",
    "divide",
    "set_tensor_model_parallel_attributes",
    "shard_master_weight",
]
