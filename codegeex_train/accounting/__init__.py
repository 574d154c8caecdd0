"""Communication and memory per rank: counted at run time, and predicted from the shapes; the memory check a run
passes before anything is built (``fit.py``, against what ``available.py`` reads the host and GPU have free)."""

from codegeex_train.accounting.counter import CommCounter
from codegeex_train.accounting.theory import (
                     MemoryParts,
                     Workload,
                     activation_parts,
                     comm_bytes_per_step,
                     expected_memory_report,
                     memory_per_rank,
                     stage_parameters,
                     tp_bytes_per_microbatch,
)

__all__ = ["CommCounter", "MemoryParts", "Workload", "activation_parts", "comm_bytes_per_step",
           "expected_memory_report", "memory_per_rank", "stage_parameters", "tp_bytes_per_microbatch"]
