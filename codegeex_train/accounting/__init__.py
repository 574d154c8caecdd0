"""Communication and memory per rank: counted at run time, and predicted from the shapes; the memory check a run
passes before anything is built (``fit.py``, against what ``available.py`` reads the host and GPU have free).

==================  ======================================================================================
``theory.py``       ``Workload`` (a model and the run's ``ParallelPlan``): bytes moved per step by group and memory
                    by part, per rank, from the shapes alone
``counter.py``      ``CommCounter``: bytes the collectives actually move, by group
``memory.py``       memory by part, measured; ``StepMemory``, the probe the training loop is handed for one step
``fit.py``          will the run fit: the check before anything is built, and the flags that would make it fit
``available.py``    what this host and GPU have free
``planner.py``      the layout planner: every layout training accepts, ranked by its estimate
==================  ======================================================================================

May import: ``model`` (FLOPs per layer), ``metrics`` (peak memory), ``config``, ``pipeline`` (schedules, stage
splits), ``data`` (the sample index's size), ``distributed`` and ``tensor_parallel`` (recompute's observers). The
training loop never imports it (an import contract): pretrain.py hands the loop what accounting measures with, and
the loop hands the figures back after the step.
"""

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
