"""RNG streams for dropout under tensor parallelism.

Replicated activations (after a g all-reduce: residual stream, embeddings) must draw the SAME dropout
mask on every TP rank, or the ranks' copies diverge. Sharded activations (attention probabilities of
this rank's heads) must draw DIFFERENT masks, or every shard repeats one mask. So the default generator
is seeded identically across the TP group, and a second, TP-rank-dependent stream is swapped in with
``tracker.fork()`` around dropout inside the TP region. Works on CPU and CUDA generators alike.
"""

from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the default stream and the TP stream, so the two never coincide.
_TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states for one device; ``fork(name)`` runs a block on that stream and advances it."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call model_parallel_seed() first")
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """For checkpoints: resuming must continue the same dropout masks."""
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def model_parallel_seed(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> RNGStatesTracker:
    """Seed the default stream with ``seed`` (same on all TP ranks) and return a tracker whose
    model-parallel stream is ``seed + 2718 + tp_rank`` (different on each TP rank)."""
    device = torch.device(device)
    torch.manual_seed(seed)  # seeds CPU and every CUDA device
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    return tracker


class _CheckpointFunction(torch.autograd.Function):
    """Drop a block's activations in forward and recompute them in backward under the same RNG states
    (default stream and every tracker stream), so dropout masks and thus results are unchanged."""

    @staticmethod
    def forward(ctx, function, tracker, device, *args):
        ctx.function, ctx.tracker, ctx.device = function, tracker, device
        ctx.rng_state = _get_state(device)
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.tracker_states = tracker.get_states() if tracker is not None else None
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        # Swap in the forward-time states, recompute, then put the current states back.
        now = (_get_state(ctx.device), torch.get_rng_state(), ctx.tracker.get_states() if ctx.tracker else None)
        _set_state(ctx.rng_state, ctx.device)
        torch.set_rng_state(ctx.cpu_rng_state)
        if ctx.tracker is not None:
            ctx.tracker.set_states(ctx.tracker_states)
        with torch.enable_grad():
            outputs = ctx.function(*inputs)
        _set_state(now[0], ctx.device)
        torch.set_rng_state(now[1])
        if ctx.tracker is not None:
            ctx.tracker.set_states(now[2])
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None) + tuple(x.grad if x.requires_grad else None for x in inputs)


def recompute_activations(function, tracker: RNGStatesTracker | None, *args: torch.Tensor):
    """Activation checkpointing of ``function(*args)`` (tensor args only) that keeps dropout exact: its activations
    are dropped after the forward and recomputed in backward, with the RNG streams of the first run (Megatron's
    ``tensor_parallel.checkpoint``; named for what it does, beside the ``checkpoint`` package of saved runs)."""
    device = tracker.device if tracker is not None else torch.device("cpu")
    return _CheckpointFunction.apply(function, tracker, device, *args)
