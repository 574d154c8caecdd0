"""The ranks of a job and how they are set up.

==================  ======================================================================================
``topology.py``     Megatron's process groups in the one rank order of ``layout.dims.ParallelDims`` (TP contiguous,
                    then CP, DP, PP) as a pure function of the sizes; ``Topology`` (this rank's groups and
                    coordinates); DeepSpeed's ``mpu`` adapter. The run's whole plan (batch, stages, activation
                    shape) is ``layout.plan.ParallelPlan``, whose ``dims`` these are
``cluster.py``      joining the job (SLURM, torchrun, the DeepSpeed launcher) with bounded waits, and the report
                    of which node each rank runs on
``malloc.py``       fixed glibc malloc thresholds for CPU ranks (flat memory)
``log.py``          rank-aware console logging (``setup_logging``: rank 0 at ``--log-level``, the others warnings
                    and errors, ``--log-all-ranks``); modules log with ``logging.getLogger(__name__)``
``spawn.py``        ``run_distributed``: a function on N gloo ranks of this host, without a launcher (the tests and
                    the benchmarks that start their own ranks), laid out by sizes or by a ``ParallelPlan``
==================  ======================================================================================

May import ``layout`` only: every other package builds on it.
"""
