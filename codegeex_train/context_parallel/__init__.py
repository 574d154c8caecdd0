"""Context parallelism: the sequence split over the CP ranks. Owns the load-balanced token layout (chunks.py: CP rank
r holds chunks r and 2N-1-r of 2N, and its inverse) and ring attention over the CP group (ring_attention.py: K/V
passed round the ring with point-to-point, partial results merged by log-sum-exp, dK/dV passed back the same way,
and the bytes it sends).

May import tensor_parallel (the RNG tracker, group helpers) and layout (the sequence split's rule), nothing else of
codegeex_train: attention receives the CP group it uses. The function is imported from its module, ``from
codegeex_train.context_parallel.ring_attention import ring_attention``: exported here under its module's name it
would hide the module (``mock.patch`` and ``import ... as`` of codegeex_train.context_parallel.ring_attention would
find the function)."""

from codegeex_train.context_parallel.chunks import (
    check_context_parallel_length,
    context_parallel_indices,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from codegeex_train.context_parallel.ring_attention import RingBytes, ring_attention_bytes

__all__ = [
    "check_context_parallel_length",
    "context_parallel_indices",
    "gather_from_context_parallel",
    "split_for_context_parallel",
    "ring_attention_bytes",
    "RingBytes",
]
