"""The DeepSpeed engine around a model: optimizer, LR schedule, ZeRO over our data-parallel groups.

Written once, for pretraining and the benchmarks: ``deepspeed.initialize`` gets a torch AdamW instance (no
JIT-built optimizer op), our LR schedule, and the ``mpu`` that hands ZeRO the DP and model-parallel groups
(``distributed/topology.py``) when the model is tensor- or pipeline-parallel. Its checkpoint engine is replaced by
``checkpoint/deepspeed_checkpoint.py``'s ``SafeCheckpointEngine``: every file DeepSpeed loads is unpickled weights-only, and a
failed write is reported by ``save_checkpoint`` instead of raised out of the middle of DeepSpeed's save.
"""

from __future__ import annotations

from torch import nn

from codegeex_train.checkpoint.deepspeed_checkpoint import install_checkpoint_engine
from codegeex_train.config.arguments import OptimConfig
from codegeex_train.distributed.topology import DeepSpeedMPU, Topology
from codegeex_train.training.optim import LRSchedule, build_optimizer


def build_engine(model: nn.Module, optim: OptimConfig, train_iters: int, ds_config: dict,
                 topology: Topology | None = None, global_batch_size: int | None = None):
    """``deepspeed.initialize`` of ``model`` with AdamW (or SGD) and the LR schedule of ``optim`` over
    ``train_iters`` steps (``global_batch_size``: recorded with the schedule, which a resume compares); ``topology``
    None: plain data parallelism over the world (no mpu)."""
    import deepspeed

    optimizer = build_optimizer(model, optim)
    schedule = LRSchedule(optimizer, optim, train_iters, global_batch_size)
    mpu = DeepSpeedMPU(topology) if topology is not None else None
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, mpu=mpu,
                                           config=ds_config, dist_init_required=False)
    install_checkpoint_engine(engine)
    return engine
