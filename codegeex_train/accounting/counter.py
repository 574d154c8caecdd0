"""Bytes moved, by process group, counted where the collectives are issued.

``CommCounter`` wraps the ``torch.distributed`` functions while it is installed, so it sees our own
collectives (TP f/g, vocab-parallel loss, pipeline point-to-point, the tied-embedding sum) and DeepSpeed's
alike (its ``deepspeed.comm`` backend calls ``torch.distributed``; the two functions it binds once at start-up,
all-gather-into-tensor and reduce-scatter-tensor, are re-pointed too). Each call is attributed to the group
it names, looked up by identity in the topology's groups.

Volume is seed 000's: an all-reduce of N bytes is a reduce-scatter and an all-gather of N each, 2N; an
all-gather or a reduce-scatter moves the whole tensor once (N, the gathered output / the scattered input);
a reduce, a broadcast and a send move N; a receive is counted by its sender. A ring all-reduce over p ranks
sends 2N(p-1)/p from every rank: the seed's 2N is its large-p limit. Nothing moves inside a group of one rank.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist

# name -> (the argument whose bytes count, factor)
_VOLUME = {
    "all_reduce": ("tensor", 2),
    "reduce": ("tensor", 1),
    "broadcast": ("tensor", 1),
    "all_gather": ("tensor_list", 1),
    "all_gather_into_tensor": ("output_tensor", 1),
    "all_gather_single": ("output_tensor", 1),  # newer torch's name for the one above
    "reduce_scatter": ("input_list", 1),
    "reduce_scatter_tensor": ("input", 1),
    "reduce_scatter_single": ("input", 1),
    "all_to_all_single": ("input", 1),
    "send": ("tensor", 1),
    "batch_isend_irecv": ("p2p_op_list", 1),  # counted op by op: the sends only
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):  # tensor lists (all-gather outputs, reduce-scatter inputs)
        return sum(_nbytes(v) for v in value)
    return 0


class CommCounter:
    """``with CommCounter(topology.named_groups()) as comm: ...`` then ``comm.take()`` -> bytes by group name.

    ``groups`` maps a name to a process group (``None``: the default group, as ``"world"`` when not named).
    ``record=True`` also keeps every call as ``(op, group name, bytes)`` in ``calls``, for tests. Calls made
    while another counted call is running (a collective built from collectives) count once, at the outside.
    """

    def __init__(self, groups: dict[str, object] | None = None, record: bool = False):
        self._names = {id(g): name for name, g in (groups or {}).items() if g is not None}
        self.record = record
        self.bytes: dict[str, int] = defaultdict(int)
        self.counts: dict[str, int] = defaultdict(int)
        self.calls: list[tuple[str, str, int]] = []
        self._depth = threading.local()
        self._saved: list[tuple[object, str, object]] = []

    def group_name(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            return self._names.get(id(dist.group.WORLD), "world")
        return self._names.get(id(group), "other")

    def _count(self, op: str, group, nbytes: int) -> None:
        if group is not None and dist.get_world_size(group) == 1:
            return  # nothing leaves the rank
        name = self.group_name(group)
        self.bytes[name] += nbytes
        self.counts[name] += 1
        if self.record:
            self.calls.append((op, name, nbytes))

    def _wrap(self, op: str, original):
        signature = inspect.signature(original)
        argument, factor = _VOLUME[op]

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                bound = signature.bind_partial(*args, **kwargs).arguments
                if op == "batch_isend_irecv":
                    ops = bound.get("p2p_op_list", [])
                    for p2p in ops:
                        if p2p.op.__name__ == "isend":
                            self._count("send", p2p.group, _nbytes(p2p.tensor))
                else:
                    self._count(op, bound.get("group"), factor * _nbytes(bound.get(argument)))
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        return counted

    def _patch(self, owner, attr: str, op: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return
        self._saved.append((owner, attr, original))
        setattr(owner, attr, self._wrap(op, original))

    def __enter__(self) -> "CommCounter":
        for op in _VOLUME:
            self._patch(dist, op, op)
        try:  # DeepSpeed's backend bound these two at init_distributed: re-point them too
            from deepspeed.comm import comm as ds_comm
        except ImportError:
            ds_comm = None
        backend = getattr(ds_comm, "cdb", None)
        if backend is not None:
            self._patch(backend, "all_gather_function", "all_gather_into_tensor")
            self._patch(backend, "reduce_scatter_function", "reduce_scatter_tensor")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def take(self) -> dict[str, int]:
        """Bytes by group name since the last take (or the start); resets the counts."""
        taken = dict(self.bytes)
        self.bytes.clear()
        self.counts.clear()
        return taken
