"""The ranks of a job and how they are set up.

==================  ======================================================================================
``topology.py``     ``ParallelDims`` (tp, cp, pp, dp) and Megatron's process groups in its one rank order (TP
                    contiguous, then CP, DP, PP) as a pure function of the sizes; ``Topology`` (this rank's groups
                    and coordinates); DeepSpeed's ``mpu`` adapter. The run's whole plan (batch, stages, activation
                    shape) is ``config.plan.ParallelPlan``, whose ``dims`` these are
``cluster.py``      joining the job (SLURM, torchrun, the DeepSpeed launcher) with bounded waits, and the report
                    of which node each rank runs on
``malloc.py``       fixed glibc malloc thresholds for CPU ranks (flat memory)
``log.py``          rank-aware console logging (``setup_logging``: rank 0 at ``--log-level``, the others warnings
                    and errors, ``--log-all-ranks``); modules log with ``logging.getLogger(__name__)``
==================  ======================================================================================

May import nothing else of codegeex_train: every other package builds on it.
"""
