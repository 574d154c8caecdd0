"""The training loop: the pipeline schedule's micro-batches -> tied-embedding gradient sum -> (DeepSpeed:
clip, step, LR) -> metrics, eval and checkpoints. PP = 1 runs the same loop with no pipelining."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Protocol

import torch
import torch.distributed as dist

from codegeex_train.checkpoint.manager import CheckpointManager
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.config.arguments import LoggingConfig, TrainConfig
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.distributed.topology import Topology
from codegeex_train.metrics import memory_gb, redact_secrets, throughput_record
from codegeex_train.pipeline import (
    P2PCommunicator,
    allreduce_shared_embedding_grads,
    interleaved_one_f_one_b,
    run_schedule,
    with_p2p_ops,
)
from codegeex_train.tensor_parallel import RNGStatesTracker
from codegeex_train.training.batches import DocumentMasking
from codegeex_train.training.exit_conditions import ExitConditions, NumericalHealth, NumericalHealthError
from codegeex_train.training.profiling import Profiling
from codegeex_train.training.engine_stage import ChunkedEngineStage, EngineStage

logger = logging.getLogger(__name__)


class StepProbe(Protocol):
    """What measures one training step from inside it (accounting.memory.StepMemory); the loop calls its three
    points and, after the step, logs ``record(iteration)``."""

    def first_forward(self) -> ContextManager | None: ...  # wraps micro-batch 0's forward
    def schedule(self) -> ContextManager: ...  # wraps the step's schedule
    def at_boundary(self, engine) -> None: ...  # after the last backward, before the optimizer step
    def record(self, iteration: int) -> dict: ...


class CommCount(Protocol):
    """Bytes moved by group while training (accounting.CommCounter): a context manager; ``take()`` -> bytes by
    group name since the last take."""

    def __enter__(self) -> "CommCount": ...
    def __exit__(self, *exc) -> None: ...
    def take(self) -> dict[str, int]: ...


class _NoCount:
    def __enter__(self) -> "_NoCount":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def take(self) -> dict[str, int]:
        return {}


@dataclass
class Measurement:
    """What pretrain.py hands the loop to measure with (accounting's; the loop imports no accounting): ``comm``
    counts the bytes of the training steps, ``comm_theory`` is their prediction per step by group (logged beside),
    ``memory`` makes the probe of the step that measures memory (the run's second)."""

    comm: CommCount | None = None
    comm_theory: dict[str, int] | None = None
    memory: Callable[[], StepProbe] | None = None


@dataclass
class Run:
    """Everything the loop touches, built once by pretrain.py: the plan, the typed sections it reads, the built
    parts and what is plugged in (evaluation, measurement) as callbacks."""

    plan: ParallelPlan
    model: ModelConfig  # the model's shape with the tokenizer's vocabulary
    train: TrainConfig  # iterations, intervals, saving, exit and numerical-health settings
    logging: LoggingConfig
    topology: Topology
    engine: object  # deepspeed.DeepSpeedEngine
    tracker: RNGStatesTracker
    device: torch.device
    logger: object  # MetricsLogger
    flops_per_iteration: float
    peak_flops_per_device: float | None = None  # for MFU; None on CPU
    p2p: P2PCommunicator | None = None  # None: built from the topology and the plan's activation shape
    exit_conditions: ExitConditions | None = None  # SIGTERM / wall-clock stops; None: never
    measurement: Measurement | None = None  # None: nothing counted or measured
    # --eval-humaneval-interval: iteration -> the record's metrics (or None: nothing to log on this rank), handed
    # over by pretrain.py so that the loop imports no evaluation or generation.
    evaluate_humaneval: Callable[[int], dict | None] | None = None
    evaluate_infilling: Callable[[int], dict | None] | None = None  # --eval-infilling-interval, as evaluate_humaneval
    masking: DocumentMasking | None = None  # --reset-position-ids / --reset-attention-mask / --eod-mask-loss
    # Tests only (training/fault_injection.py): iteration -> a context the step runs in. None costs nothing.
    step_context: Callable[[int], ContextManager] | None = None
    profiling: Profiling | None = None  # --profile / --record-memory-history on this rank; None: neither
    # --save: which steps save, sync or --async-save, retention, the preemption marker (checkpoint/manager.py); the
    # default saves nothing
    checkpoints: CheckpointManager = field(default_factory=CheckpointManager)

    def __post_init__(self) -> None:
        if self.p2p is None:
            self.p2p = P2PCommunicator.for_plan(self.topology, self.plan, self.device)
        if self.measurement is None:
            self.measurement = Measurement()

    @property
    def reads_data(self) -> bool:
        """The first stage reads input ids, the last labels; middle stages only the document ids of
        --reset-attention-mask."""
        masked = self.masking is not None and self.masking.reset_attention_mask
        return self.topology.is_first_stage or self.topology.is_last_stage or masked

    def stage(self, batches: Iterator[dict] | None, first_forward_context=None) -> EngineStage:
        return (ChunkedEngineStage if self.plan.num_chunks > 1 else EngineStage)(
            self.engine, batches, self.plan, coords=self.topology.coords, device=self.device,
            first_forward_context=first_forward_context, masking=self.masking)

    def schedule(self, *, train: bool = True, num_microbatches: int | None = None):
        """This rank's ops for one training step (1F1B, interleaved when v > 1) or a forward-only pass."""
        topo, v = self.topology, self.plan.num_chunks
        m = num_microbatches or self.plan.num_microbatches
        steps = interleaved_one_f_one_b(topo.pp_size, topo.pp_rank, m, v)
        if not train:  # the same (micro-batch, chunk) order, forwards only
            steps = [s for s in steps if s.kind == "F"]
        return with_p2p_ops(steps, topo.is_first_stage, topo.is_last_stage, v)


def train_step(run: Run, batches: Iterator[dict] | None, probe: StepProbe | None = None) -> torch.Tensor:
    """One optimizer step: the 1F1B schedule over ``num_microbatches`` micro-batches (plain accumulation when
    PP = 1), the tied embedding's gradients summed, then DeepSpeed's step. Returns the last stage's mean loss
    (on device, no host sync; zero on other stages). With ``probe`` the step is measured at its three points."""
    stage = run.stage(batches, probe.first_forward() if probe is not None else None)
    with probe.schedule() if probe is not None else contextlib.nullcontext():
        run_schedule(run.schedule(), stage, run.p2p)
    allreduce_shared_embedding_grads(run.engine.module, run.topology)
    if probe is not None:
        probe.at_boundary(run.engine)
    run.engine.step()  # the boundary: clip, optimizer step, LR schedule
    return stage.mean_loss()


def dp_mean(value: torch.Tensor, topology: Topology) -> float:
    """Average over the ranks that saw different tokens (``data_shards``: DP x CP; a collective and a host sync: only
    when logging)."""
    value = value.detach().float().clone()
    size = topology.dims.data_shards
    if size > 1:
        dist.all_reduce(value, group=topology.data_shard_group)
    return value.item() / size


@torch.no_grad()
def evaluate(run: Run, data_loader) -> float:
    """Mean loss over ``--eval-iters`` global batches, from the start of the split every time, so successive
    evaluations are comparable."""
    run.engine.eval()
    stage = run.stage(iter(data_loader) if run.reads_data else None)
    run_schedule(run.schedule(train=False, num_microbatches=run.train.eval_iters * run.plan.num_microbatches),
                 stage, run.p2p)
    run.engine.train()
    return dp_mean(stage.mean_loss(), run.topology)


def _log_eval(run: Run, state: TrainState, split: str, loss: float) -> None:
    run.logger.log({"iteration": state.iteration, "split": split, f"{split}_loss": loss,
                    f"{split}_ppl": math.exp(min(loss, 50.0))})


def comm_record(measured: dict[str, int], iterations: int, theory: dict | None) -> dict:
    """``comm_<group>_bytes``: bytes this rank moved per training step (mean over the log interval), counted at
    the collectives; ``comm_<group>_bytes_theory`` beside it. Evaluation and logging traffic is not included."""
    record = {}
    for group in sorted(set(measured) | set(theory or {})):
        record[f"comm_{group}_bytes"] = measured.get(group, 0) // max(iterations, 1)
        if theory is not None and group in theory:
            record[f"comm_{group}_bytes_theory"] = theory[group]
    return record


def _train_record(run: Run, state: TrainState, loss: torch.Tensor, seconds_per_iteration: float,
                  skipped_iterations: int = 0, comm_bytes: dict | None = None, comm_iterations: int = 0) -> dict:
    engine, plan = run.engine, run.plan
    grad_norm = engine.get_global_grad_norm()
    optimizer = engine.optimizer
    return {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_train_samples,
        "global_batch_size": plan.global_batch_size,
        "lr": engine.get_lr()[0],
        "loss": dp_mean(loss, run.topology),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "loss_scale": float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 1.0))),
        "skipped_iterations": skipped_iterations,  # steps DeepSpeed skipped (fp16 overflow) in this log interval
        **throughput_record(seconds_per_iteration, plan.tokens_per_step, run.flops_per_iteration, plan.world_size,
                            run.peak_flops_per_device),
        "memory_gb": memory_gb(run.device),
        **comm_record(comm_bytes or {}, comm_iterations, run.measurement.comm_theory),
    }


def _numerical_health(run: Run) -> NumericalHealth:
    t = run.train
    # fp16: a non-finite gradient norm is an overflow, which DeepSpeed skips (counted, limited), not an error.
    return NumericalHealth(every_iteration=t.check_for_nan_in_loss_and_grad, check_grad_norm=run.plan.dtype != "fp16",
                           max_consecutive_skipped=t.max_consecutive_skipped_iterations,
                           skipped_steps=getattr(run.engine, "skipped_steps", 0), device=run.device)


def _health_error(run: Run, iteration: int, problem: str) -> NumericalHealthError:
    """The one message (logged by rank 0) naming the iteration and the last good checkpoint."""
    message = redact_secrets(f"{problem}; stopped at iteration {iteration} without saving it. Last good checkpoint: "
                             f"{run.checkpoints.last_good()}")
    if run.topology.rank == 0:
        logger.error(message)
    return NumericalHealthError(message)


def _checked_train_step(run: Run, batches, health: NumericalHealth, iteration: int,
                        probe: StepProbe | None = None) -> torch.Tensor:
    """``train_step``, with DeepSpeed's own give-up (fp16 loss scale at its minimum, raised on every rank alike)
    turned into the same clear error."""
    try:
        with run.step_context(iteration) if run.step_context else contextlib.nullcontext():
            return train_step(run, batches, probe)
    except Exception as error:
        if "loss scale already at minimum" not in str(error):
            raise
        raise _health_error(run, iteration, f"{health.consecutive_skipped + 1} consecutive iterations were "
                            f"skipped by fp16 dynamic loss scaling and the loss scale is at its minimum "
                            f"(fp16.min_loss_scale): the gradients overflow at every loss scale") from None


def train(run: Run, state: TrainState, train_loader, valid_loader=None, test_loader=None) -> TrainState:
    with run.measurement.comm or _NoCount() as comm:
        return _train(run, state, train_loader, valid_loader, test_loader, comm)


def _train(run: Run, state: TrainState, train_loader, valid_loader, test_loader, comm: CommCount) -> TrainState:
    t, log_interval = run.train, run.logging.log_interval
    batches = iter(train_loader) if run.reads_data else None
    start_iteration = state.iteration
    step_seconds, interval_iters = 0.0, 0  # time in training steps only, not eval or saving
    loss_sum = torch.zeros((), device=run.device)
    health = _numerical_health(run)
    exits = run.exit_conditions or ExitConditions(signal_handler=False, duration_mins=None, start_time=time.time(),
                                                  device=run.device)
    step_comm: dict[str, int] = {}
    # Measured once, at the run's second step: the first creates the optimizer's state.
    memory_iteration = min(start_iteration + 2, t.train_iters)
    while state.iteration < t.train_iters:
        comm.take()  # drop what eval, logging and the exit checks moved: only training steps are accounted
        step_start = time.perf_counter()
        measure = run.measurement.memory if state.iteration + 1 == memory_iteration else None
        probe = measure() if measure is not None else None
        with run.profiling.step(state.iteration + 1) if run.profiling else contextlib.nullcontext():
            loss = _checked_train_step(run, batches, health, state.iteration + 1, probe)
        if probe is not None:  # the measured figures go to accounting, after the step
            run.logger.log(probe.record(state.iteration + 1))
        for group, n in comm.take().items():
            step_comm[group] = step_comm.get(group, 0) + n
        loss_sum += loss
        state.iteration += 1
        state.consumed_train_samples += run.plan.global_batch_size
        interval_iters += 1
        run.logger.advance(state.iteration)
        health.observe(state.iteration, loss, run.engine.get_global_grad_norm(),
                       getattr(run.engine, "skipped_steps", 0))
        scheduled_last = state.iteration == t.train_iters or (
            t.exit_interval is not None and state.iteration - start_iteration >= t.exit_interval)
        # Iterations that log or save are always checked, whatever --check-for-nan-in-loss-and-grad says.
        due = (scheduled_last or run.checkpoints.saves_at(state.iteration) or state.iteration % log_interval == 0
               or state.iteration == start_iteration + 1 or health.too_many_skipped)
        stop_reason = exits.check(health, due=due)  # the same on every rank
        last = stop_reason is not None or scheduled_last
        failed = health.problem is not None  # the same on every rank: logged below, then raised, never saved

        # A run's first iteration is always logged: its loss is the sanity check of a (re)start.
        if state.iteration % log_interval == 0 or last or failed or state.iteration == start_iteration + 1:
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)  # honest timing: wait for queued kernels
            step_seconds += time.perf_counter() - step_start
            run.logger.log(_train_record(run, state, loss_sum / interval_iters, step_seconds / interval_iters,
                                         health.take_skipped_in_interval(), step_comm, interval_iters))
            step_comm = {}
            loss_sum.zero_()
            step_seconds, interval_iters = 0.0, 0
        else:
            step_seconds += time.perf_counter() - step_start
        if run.profiling:  # after the timing: setting the profiler up and writing its trace are not the step's
            run.profiling.after_step(state.iteration)
        if failed:
            run.checkpoints.finish()  # a save in flight is of an earlier, checked iteration: it becomes `latest` first
            raise _health_error(run, state.iteration, health.problem)
        if (valid_loader is not None and t.eval_interval and state.iteration % t.eval_interval == 0
                and stop_reason is None):  # preempted: the grace period is for the checkpoint
            _log_eval(run, state, "valid", evaluate(run, valid_loader))
        if (run.evaluate_humaneval and t.eval_humaneval_interval and state.iteration % t.eval_humaneval_interval == 0
                and stop_reason is None):
            metrics = run.evaluate_humaneval(state.iteration)
            if metrics is not None:
                run.logger.log({"iteration": state.iteration, "split": "humaneval", **metrics})
        if (run.evaluate_infilling and t.eval_infilling_interval and state.iteration % t.eval_infilling_interval == 0
                and stop_reason is None):
            metrics = run.evaluate_infilling(state.iteration)
            if metrics is not None:
                run.logger.log({"iteration": state.iteration, "split": "infilling", **metrics})
        # Saves on schedule and at the last iteration; stopped by a signal, rank 0 writes the `preempted` marker.
        saved_tag = run.checkpoints.step(state, last=last, preempted=exits.stopped_by_signal)
        if stop_reason is not None and run.topology.rank == 0:
            saved = f"saved {saved_tag} to {t.save}" if t.save else "no --save: nothing saved"
            logger.info(f"{stop_reason}: stopping after iteration {state.iteration}; {saved}. Relaunch the same "
                        f"command (with --load) to resume.")
        if last:
            break
    if test_loader is not None and state.iteration == t.train_iters:
        _log_eval(run, state, "test", evaluate(run, test_loader))
    return state
