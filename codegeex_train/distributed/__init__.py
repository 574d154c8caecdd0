"""The ranks of a job and how they are set up.

==================  ======================================================================================
``topology.py``     Megatron's process groups (TP contiguous, then DP, then PP) as a pure function of the sizes;
                    ``Topology`` (this rank's groups and coordinates); DeepSpeed's ``mpu`` adapter
``layout.py``       ``Layout``: the ranks, the global batch over DP ranks and micro-batches, layers over stages
``cluster.py``      joining the job (SLURM, torchrun, the DeepSpeed launcher) with bounded waits, and the report
                    of which node each rank runs on
``malloc.py``       fixed glibc malloc thresholds for CPU ranks (flat memory)
==================  ======================================================================================

May import nothing else of codegeex_train: every other package builds on it.
"""
