"""The training loop: micro-batches -> (DeepSpeed: clip, step, LR) -> metrics, eval and checkpoints."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..arguments import Args, BatchPlan
from ..tensor_parallel import RNGStatesTracker
from ..topology import Topology
from .checkpointing import TrainState, save_checkpoint
from .data import get_batch
from .metrics import memory_gb, throughput_record


@dataclass
class Run:
    """Everything the loop touches, built once by pretrain.py."""

    args: Args
    plan: BatchPlan
    topology: Topology
    engine: object  # deepspeed.DeepSpeedEngine
    tracker: RNGStatesTracker
    device: torch.device
    logger: object  # MetricsLogger
    flops_per_iteration: float
    peak_flops_per_device: float | None = None  # for MFU; None on CPU


def masked_mean(loss_per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (loss_per_token * loss_mask).sum() / loss_mask.sum()


def train_step(run: Run, batches: Iterator[dict]) -> torch.Tensor:
    """One optimizer step over ``num_microbatches`` micro-batches; returns this rank's mean loss (on device,
    no host sync). DeepSpeed scales each backward by 1/accumulation and steps at the last micro-batch."""
    engine, losses = run.engine, []
    for _ in range(run.plan.num_microbatches):
        b = get_batch(next(batches), run.device)
        loss = masked_mean(engine(b["input_ids"], b["position_ids"], labels=b["labels"]), b["loss_mask"])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def dp_mean(value: torch.Tensor, topology: Topology) -> float:
    """Average over data-parallel ranks (a collective and a host sync: only when logging)."""
    value = value.detach().float().clone()
    if topology.dp_size > 1:
        dist.all_reduce(value, group=topology.dp_group)
    return value.item() / topology.dp_size


@torch.no_grad()
def evaluate(run: Run, data_loader) -> float:
    """Mean loss over ``--eval-iters`` global batches, from the start of the split every time, so successive
    evaluations are comparable."""
    run.engine.eval()
    batches, losses = iter(data_loader), []
    for _ in range(run.args.train.eval_iters * run.plan.num_microbatches):
        b = get_batch(next(batches), run.device)
        losses.append(masked_mean(run.engine(b["input_ids"], b["position_ids"], labels=b["labels"]),
                                  b["loss_mask"]))
    run.engine.train()
    return dp_mean(torch.stack(losses).mean(), run.topology)


def _log_eval(run: Run, state: TrainState, split: str, loss: float) -> None:
    run.logger.log({"iteration": state.iteration, "split": split, f"{split}_loss": loss,
                    f"{split}_ppl": math.exp(min(loss, 50.0))})


def _train_record(run: Run, state: TrainState, loss: torch.Tensor, seconds_per_iteration: float) -> dict:
    engine, plan = run.engine, run.plan
    grad_norm = engine.get_global_grad_norm()
    optimizer = engine.optimizer
    return {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_train_samples,
        "lr": engine.get_lr()[0],
        "loss": dp_mean(loss, run.topology),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "loss_scale": float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 1.0))),
        **throughput_record(seconds_per_iteration, plan.global_batch_size * run.args.train.seq_length,
                            run.flops_per_iteration, plan.dims.world_size, run.peak_flops_per_device),
        "memory_gb": memory_gb(run.device),
    }


def train(run: Run, state: TrainState, train_loader, valid_loader=None, test_loader=None) -> TrainState:
    t, log_interval = run.args.train, run.args.logging.log_interval
    batches = iter(train_loader)
    start_iteration = state.iteration
    step_seconds, interval_iters = 0.0, 0  # time in training steps only, not eval or saving
    loss_sum = torch.zeros((), device=run.device)
    while state.iteration < t.train_iters:
        step_start = time.perf_counter()
        loss_sum += train_step(run, batches)
        state.iteration += 1
        state.consumed_train_samples += run.plan.global_batch_size
        interval_iters += 1
        run.logger.advance(state.iteration)
        last = state.iteration == t.train_iters or (
            t.exit_interval is not None and state.iteration - start_iteration >= t.exit_interval)

        # A run's first iteration is always logged: its loss is the sanity check of a (re)start.
        if state.iteration % log_interval == 0 or last or state.iteration == start_iteration + 1:
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)  # honest timing: wait for queued kernels
            step_seconds += time.perf_counter() - step_start
            run.logger.log(_train_record(run, state, loss_sum / interval_iters, step_seconds / interval_iters))
            loss_sum.zero_()
            step_seconds, interval_iters = 0.0, 0
        else:
            step_seconds += time.perf_counter() - step_start
        if valid_loader is not None and t.eval_interval and state.iteration % t.eval_interval == 0:
            _log_eval(run, state, "valid", evaluate(run, valid_loader))
        saving = t.save and (last or (t.save_interval and state.iteration % t.save_interval == 0))
        if saving:
            state.wandb_run_id = run.logger.wandb_run_id
            save_checkpoint(run.engine, t.save, state, run.args.model, run.topology, run.tracker)
        if last:
            break
    if test_loader is not None and state.iteration == t.train_iters:
        _log_eval(run, state, "test", evaluate(run, test_loader))
    return state
