"""What a GPU-check unit runs in: a process of its own (``benchmarks/gpu.py --child UNIT``) that joins a
torch.distributed world of one the way pretrain.py joins it, writes what it has measured to a state file after every
change (a timeout keeps the partial data) and stops iterating when its deadline passes."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback


class State:
    """What a unit has measured so far, rewritten atomically after every change (a timeout keeps the partial data)."""

    def __init__(self, path: str):
        self.path = path
        self.doc: dict = {"data": {}, "notes": []}
        self.flush()

    def set(self, **values) -> None:
        self.doc["data"].update(values)
        self.flush()

    def note(self, text: str) -> None:
        self.doc["notes"].append(text)
        print(f"note: {text}", flush=True)
        self.flush()

    def flush(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f)
        os.replace(tmp, self.path)


class Deadline:
    def __init__(self, at: float | None):
        self.at = at

    def passed(self) -> bool:
        return self.at is not None and time.time() > self.at


def sync(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def world_of_one():
    """Join a one-rank process group as pretrain.py does (NCCL on CUDA, gloo on CPU) and build the topology."""
    import torch

    from codegeex_train import pretrain
    from codegeex_train.config.arguments import ParallelConfig
    from codegeex_train.layout.dims import ParallelDims

    if os.environ.get("DS_ACCELERATOR") != "cpu" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
    return pretrain.init_distributed(ParallelConfig(distributed_timeout_minutes=5.0), ParallelDims(1, 1))


def build_run(topology, device, model_config, *, precision: str, seq_length: int, micro_batch_size: int,
              num_microbatches: int, train_iters: int, seed: int, checkpoint_activations: bool = False,
              ds_user: dict | None = None, lr: float = 6e-4):
    """Model, ZeRO-2 engine and the trainer's Run, wired as pretrain.py wires them (PP 1, TP 1, DP 1)."""
    from codegeex_train.config.arguments import (
        Args,
        DataConfig,
        LoggingConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )
    from codegeex_train.config.deepspeed import build_deepspeed_config
    from codegeex_train.layout.plan import ParallelPlan
    from codegeex_train.layout.recompute import Recompute
    from codegeex_train.model.codegeex import CodeGeeXModel
    from codegeex_train.model.flops import model_flops_per_iteration
    from codegeex_train.pipeline import mark_shared_embedding_copy
    from codegeex_train.tensor_parallel import model_parallel_seed
    from codegeex_train.training.engine import build_engine
    from codegeex_train.training.trainer import Run

    train = TrainConfig(micro_batch_size=micro_batch_size, seq_length=seq_length, train_iters=train_iters, seed=seed,
                        bf16=precision == "bf16", fp16=precision == "fp16", zero_stage=2,
                        checkpoint_activations=checkpoint_activations)
    optim = OptimConfig(lr=lr, lr_decay_style="constant", clip_grad=1.0)
    args = Args(model_config, ParallelConfig(), train, optim, DataConfig(), LoggingConfig())
    plan = ParallelPlan.derive(topology.dims, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                               num_layers=model_config.num_layers,
                               recompute=Recompute.full() if checkpoint_activations else Recompute(),
                               seq_length=seq_length, hidden_size=model_config.hidden_size, dtype=precision)
    ds_config = build_deepspeed_config(args, plan, ds_user)
    tracker = model_parallel_seed(seed, topology.tp_rank, device)
    model = CodeGeeXModel.for_rank(model_config, plan, topology, tracker, seed=seed, device=device)
    mark_shared_embedding_copy(model, topology)
    engine = build_engine(model, optim, train_iters, ds_config, topology)
    flops = model_flops_per_iteration(model_config, plan.global_batch_size, seq_length, checkpoint_activations)
    return Run(plan, model_config, train, LoggingConfig(), topology, engine, tracker, device, None, flops)


def weights_dtype(run) -> str:
    """The dtype the engine computes in (DeepSpeed casts the module for bf16/fp16; the fp32 master copy is ZeRO's)."""
    return str(next(run.engine.module.parameters()).dtype).removeprefix("torch.")


def free(device) -> None:
    """Collect what the caller dropped (an engine) and hand its CUDA memory back."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_child(a, measure, started: float) -> int:
    """Run unit ``a.child`` in this process: join the world of one, call ``measure(a, state, topology, device,
    deadline)`` and record how it ended in the state file (an exception too). ``started``: this process's start."""
    state = State(a.child_state)
    deadline = Deadline(a.child_deadline)
    try:
        import torch

        state.doc["torch"] = torch.__version__
        topology, device = world_of_one()
        import deepspeed

        state.doc["deepspeed"] = deepspeed.__version__
        state.doc["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        state.doc["backend"] = torch.distributed.get_backend()
        state.doc["startup_seconds"] = time.time() - started
        state.flush()
        if a.child in a.inject_error:
            raise RuntimeError(f"injected failure in unit {a.child} (--inject-error, tests only)")
        if a.child in a.inject_hang:
            state.set(hanging=True)
            time.sleep(3600)
        measure(a, state, topology, device, deadline)
        state.doc["done"] = True
        state.flush()
        return 0
    except BaseException as e:  # noqa: BLE001 - reported in the table
        traceback.print_exc()
        message = f"{type(e).__name__}: {e}".strip().splitlines()
        state.doc["error"] = message[0][:400] if message else type(e).__name__
        state.doc["oom"] = type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
        state.flush()
        return 1
    finally:
        with contextlib.suppress(Exception):  # the process ends anyway
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
