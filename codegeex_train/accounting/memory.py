"""Memory per rank, measured by part: what the tensors actually hold, on any device.

Peak RSS (CPU) or CUDA's allocator statistics say how much a process uses but not what for. Here every
distinct storage reachable from the model and its ZeRO optimizer is counted once and put in one part:
  weights     the module's parameters (ZeRO flattens them into one buffer per group; the views count once);
  optimizer   the fp32 master partition and the optimizer's state (Adam's two moments and step);
  gradients   the gradient partition ZeRO accumulates into (whole gradients of the parameters that overlap
              this rank's partition);
  buffers     every other tensor the ZeRO optimizer keeps, and ``.grad`` still alive (a bucket not yet reduced);
  activations what autograd saves for the backward of one micro-batch (a ``saved_tensors_hooks`` tally of
              distinct storages, parameters excluded; inside selective-recompute blocks too, through
              ``tensor_parallel.selective_recompute.OBSERVERS``), times the micro-batches 1F1B keeps in flight;
              interleaved 1F1B: of each model chunk's first forward (``ChunkActivations``), summed over the
              (micro-batch, chunk) pairs the schedule holds at its peak (``theory.activations_in_flight``).
The parts are comparable one by one with ``theory.memory_per_rank``. ``StepMemory`` is what the training loop is
handed to measure one step with (it calls the probe's three points and knows nothing of accounting); it turns the
figures into the metrics' ``split: memory`` record with the theory beside them.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from codegeex_train.accounting.theory import (
    Workload,
    activations_in_flight,
    memory_per_rank,
    microbatches_in_flight,
)
from codegeex_train.metrics import memory_gb
from codegeex_train.tensor_parallel.selective_recompute import OBSERVERS


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _tensors(value, depth: int = 2):
    if torch.is_tensor(value):
        yield value
    elif depth and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth - 1)
    elif depth and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth - 1)


class SavedActivations:
    """``with SavedActivations(model) as saved: <forward>``; ``saved.bytes``: distinct storages autograd saved,
    parameters (and their flat ZeRO buffers) excluded."""

    def __init__(self, model: torch.nn.Module):
        self._exclude = {_storage(p)[0] for p in model.parameters()}
        self._seen: set[int] = set()
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr and ptr not in self._exclude and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += nbytes
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        # Saved-tensor hooks do not nest: inside a selective-recompute block (tensor_parallel/selective_recompute.py) that
        # block's hooks alone run; it hands every tensor it keeps to OBSERVERS (its recipe target is not kept).
        OBSERVERS.append(self._pack)
        return self

    def __exit__(self, *exc) -> None:
        OBSERVERS.remove(self._pack)
        self._hooks.__exit__(*exc)


class ChunkActivations:
    """``with ChunkActivations(model) as saved: <a training step>``; ``saved.bytes[c]``: what autograd saved for the
    first forward of model chunk c (``model(..., chunk=c)``; micro-batch 0 in every schedule), through forward
    hooks on ``model``: the chunks of interleaved 1F1B hold different layers, so each is measured once."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.bytes: dict[int, int] = {}
        self._open: tuple[int, SavedActivations] | None = None

    def _before(self, module, args, kwargs) -> None:
        chunk = kwargs.get("chunk", 0)
        if chunk not in self.bytes and self._open is None:
            self._open = chunk, SavedActivations(module).__enter__()

    def _after(self, module, args, kwargs, output) -> None:
        if self._open is not None:
            chunk, saved = self._open
            saved.__exit__(None, None, None)
            self.bytes[chunk], self._open = saved.bytes, None

    def __enter__(self) -> "ChunkActivations":
        self._hooks = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                       self.model.register_forward_hook(self._after, with_kwargs=True)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()

    def per_chunk(self, num_chunks: int) -> list[int]:
        """Bytes by chunk, 0 .. num_chunks - 1."""
        return [self.bytes[c] for c in range(num_chunks)]


def measure_state_memory(engine) -> dict[str, int]:
    """Bytes of weights, optimizer, gradients and buffers held now by ``engine`` (a DeepSpeed engine, or any
    object with ``.module`` and ``.optimizer``). Call at the accumulation boundary, before the optimizer
    step: the gradient partition is full and (from the second step on) the optimizer's state exists."""
    parts = {"weights": 0, "optimizer": 0, "gradients": 0, "buffers": 0}
    seen: set[int] = set()

    def add(part: str, tensors) -> None:
        for t in tensors:
            ptr, nbytes = _storage(t)
            if ptr and ptr not in seen:
                seen.add(ptr)
                parts[part] += nbytes

    module, zero = engine.module, engine.optimizer
    inner = getattr(zero, "optimizer", zero)  # the wrapped torch optimizer under ZeRO
    partitioned = zero is not inner
    add("weights", (p.detach() for p in module.parameters()))
    if not partitioned:  # plain data parallel: the .grad tensors are the gradients
        add("gradients", (p.grad for p in module.parameters() if p.grad is not None))
    add("optimizer", _tensors(getattr(zero, "single_partition_of_fp32_groups", []), 1))
    add("optimizer", (t for state in inner.state.values() for t in _tensors(state, 1)))
    for name in ("averaged_gradients", "grads_in_partition"):
        add("gradients", _tensors(getattr(zero, name, None)))
    add("gradients", (p.grad for p in getattr(zero, "single_partition_of_fp32_groups", []) if p.grad is not None))
    # Under ZeRO a full .grad still alive here is a bucket not yet reduced and freed: a buffer.
    add("buffers", (p.grad for p in module.parameters() if p.grad is not None))
    if partitioned:
        add("buffers", (t for value in vars(zero).values() for t in _tensors(value)))
    return parts


class StepMemory:
    """One training step's memory by part, for the trainer's probe points (``training.trainer.train_step``):
    ``first_forward()`` wraps micro-batch 0's forward, ``schedule()`` the step's whole schedule, ``at_boundary(engine)``
    runs after the last backward and before the optimizer step (the gradient partition full, the optimizer state
    there from the 2nd step on). After the step ``record(iteration)`` is the metrics record: measured and
    predicted bytes by part of this rank (``workload`` at ``pp_rank``), and peak memory."""

    def __init__(self, module: torch.nn.Module, workload: Workload, pp_rank: int, device: torch.device):
        self.workload, self.pp_rank, self.device = workload, pp_rank, device
        # What autograd saves: micro-batch 0's forward; interleaved (v chunks), each chunk's first forward.
        v = workload.num_chunks
        self._saved = SavedActivations(module) if v == 1 else None
        self._chunks = ChunkActivations(module) if v > 1 else None
        self.measured: dict[str, int] = {}

    def first_forward(self):
        return self._saved

    def schedule(self):
        return self._chunks or nullcontext()

    def at_boundary(self, engine) -> None:
        w, i = self.workload, self.pp_rank
        if self._chunks is None:
            activations = self._saved.bytes * microbatches_in_flight(w, i)
        else:  # the schedule's peak over the (micro-batch, chunk) pairs held, each chunk as measured
            activations = activations_in_flight(self._chunks.per_chunk(w.num_chunks), w.pp_size, i,
                                                w.plan.num_microbatches)
        self.measured = {**measure_state_memory(engine), "activations": activations}

    def record(self, iteration: int) -> dict:
        """``split: memory``: this rank's bytes by part, measured and predicted, and peak memory."""
        measured, w = self.measured, self.workload
        record = {"iteration": iteration, "split": "memory", **{f"memory_{k}_bytes": v for k, v in measured.items()},
                  "memory_total_bytes": sum(measured.values())}
        theory = memory_per_rank(w, self.pp_rank).as_dict()
        record.update({f"memory_{k}_bytes_theory": v for k, v in theory.items()})
        # what the activations depend on: --sequence-parallel and --recompute-* (recompute: rebuilt in backward)
        record.update(sequence_parallel=w.sp, recompute=w.recompute.describe())
        return {**record, "memory_gb": memory_gb(self.device)}
