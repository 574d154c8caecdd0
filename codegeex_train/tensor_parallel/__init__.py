"""Hand-written Megatron tensor parallelism: f/g communication (mappings.py), the parallel layers (layers.py), the
vocab-parallel loss (cross_entropy.py), the TP-aware RNG tracker and full activation recompute (random.py: ``recompute_activations``), and
selective recomputation of a cheap op's output (selective_recompute.py). Sequence parallelism lives in the same mappings and
layers.

May import nothing else of codegeex_train: each layer receives the process group it uses."""

from codegeex_train.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from codegeex_train.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    init_normal,
    mark_sequence_parallel,
    sequence_parallel_parameter,
    set_tensor_model_parallel_attributes,
    shard_master_weight,
    split_blocks,
)
from codegeex_train.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from codegeex_train.tensor_parallel.selective_recompute import recompute_in_backward
from codegeex_train.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_seed,
    recompute_activations,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "sequence_parallel_parameter",
    "mark_sequence_parallel",
    "recompute_in_backward",
    "RNGStatesTracker",
    "model_parallel_seed",
    "recompute_activations",
    "MODEL_PARALLEL_RNG",
    "init_normal",
    "divide",
    "set_tensor_model_parallel_attributes",
    "shard_master_weight",
    "split_blocks",
]
