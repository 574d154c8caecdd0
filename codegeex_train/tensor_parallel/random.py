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
