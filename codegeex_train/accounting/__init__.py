"""Communication and memory per rank: counted at run time, and predicted from the shapes."""

from codegeex_train.accounting.counter import CommCounter
from codegeex_train.accounting.theory import (
                     MemoryParts,
                     Workload,
                     comm_bytes_per_step,
                     expected_memory_report,
                     memory_per_rank,
                     stage_parameters,
)

__all__ = ["CommCounter", "MemoryParts", "Workload", "comm_bytes_per_step", "expected_memory_report", "memory_per_rank", "stage_parameters"]
