"""Megatron process-group layout: which global ranks form each TP, CP, PP, DP, DP x CP, MP and embedding group.

The layout is a pure function of the sizes (``ParallelDims``), testable with no process group. One rank order,
Megatron's tp-cp-dp-pp (the first varies fastest):

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

TP varies fastest, so a TP group is a run of contiguous ranks and sits inside one node (TP moves the most bytes);
then CP (context parallelism: the sequence split over ranks; 1 until it is implemented, which gives exactly the
tp-dp-pp order), then DP; PP varies slowest, so pipeline stages are the groups that cross nodes first.
``build_rank_groups`` is the one function that makes every group; ``Topology`` creates them and keeps this rank's.

    python -m codegeex_train.distributed.topology --world-size 16 --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 4 [--gpus-per-node 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass
from datetime import timedelta
from itertools import product

import torch.distributed as dist

from codegeex_train.layout.dims import ParallelDims, RankCoords
from codegeex_train.layout.errors import LayoutError

Groups = list[list[int]]


@dataclass(frozen=True)
class RankGroups:
    """Every group of each kind, as lists of global ranks (the same on every process). With CP 1 a CP group is one
    rank and DP x CP is DP: ``as_dict`` then leaves both out (no group of their own is created)."""

    tp: Groups
    cp: Groups
    pp: Groups
    dp: Groups
    dp_cp: Groups
    mp: Groups
    embedding: Groups

    def as_dict(self) -> dict[str, Groups]:
        groups = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "dp_cp": self.dp_cp, "mp": self.mp,
                  "embedding": self.embedding}
        if all(len(g) == 1 for g in self.cp):
            del groups["cp"], groups["dp_cp"]
        return groups


def build_rank_groups(dims: ParallelDims) -> RankGroups:
    """Every group, in Megatron's layout: TP contiguous, CP strided by TP, DP strided by TP x CP inside a stage,
    PP strided by a stage."""
    tp, cp, dp, pp = dims.tp_size, dims.cp_size, dims.dp_size, dims.pp_size

    def groups(varying: str) -> Groups:
        """One group per fixed value of the other coordinates; the members vary along ``varying`` (a string of
        dimension names, e.g. "tp" or "dp cp"), in rank order."""
        sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        inside = varying.split()
        fixed = [d for d in ("pp", "dp", "cp", "tp") if d not in inside]
        out = []
        for outer in product(*(range(sizes[d]) for d in fixed)):
            at = dict(zip(fixed, outer))
            members = [dims.rank_of(**{f"{d}_rank": v for d, v in {**at, **dict(zip(inside, inner))}.items()})
                       for inner in product(*(range(sizes[d]) for d in inside))]
            out.append(sorted(members))
        return out

    pp_groups = groups("pp")
    # The tied word embedding lives on the first and the last stage; with PP = 1 they coincide.
    embedding_groups = [sorted({g[0], g[-1]}) for g in pp_groups]
    return RankGroups(tp=groups("tp"), cp=groups("cp"), pp=pp_groups, dp=groups("dp"), dp_cp=groups("dp cp"),
                      mp=groups("tp pp"), embedding=embedding_groups)


def warn_if_tp_spans_nodes(dims: ParallelDims, gpus_per_node: int) -> Groups:
    """Warn (not fail: it runs, just slowly) about TP groups whose ranks sit on several nodes."""
    spanning = [g for g in build_rank_groups(dims).tp if len({rank // gpus_per_node for rank in g}) > 1]
    if spanning:
        warnings.warn(
            f"{len(spanning)} TP group(s), e.g. {spanning[0]}, span nodes with {gpus_per_node} GPUs per node: "
            f"tensor-parallel all-reduces would cross the network; use a --tensor-model-parallel-size "
            f"({dims.tp_size}) that divides the GPUs per node",
            stacklevel=2,
        )
    return spanning


def _group_containing(groups: Groups, rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


class Topology:
    """This process's place in the layout and its torch.distributed groups; built once (from the plan's
    ``ParallelDims``), passed explicitly.

    Every process must build it (``new_group`` is collective over the world), after
    ``torch.distributed.init_process_group``. With CP 1 there is no CP group (``cp_group`` None, as a TP group of
    one is None for the layers) and the DP x CP group is the DP group.
    """

    def __init__(self, dims: ParallelDims, rank: int | None = None, timeout: timedelta | None = None):
        self.dims = dims
        self.rank = dist.get_rank() if rank is None else rank
        if dist.is_initialized() and dist.get_world_size() != dims.world_size:
            raise LayoutError(
                f"torch.distributed has {dist.get_world_size()} processes but the layout expects {dims.world_size}"
            )
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = dims.rank_coords(self.rank)
        self.groups = build_rank_groups(dims)
        kw = {} if timeout is None else {"timeout": timeout}
        # new_group is collective: every process creates every group, in the same order,
        # and keeps the handle of the one it belongs to.
        handles = {}
        for kind, all_groups in self.groups.as_dict().items():
            for ranks in all_groups:
                handles[(kind, tuple(ranks))] = dist.new_group(ranks, **kw)
        self._handles = handles
        self.tp_ranks = _group_containing(self.groups.tp, self.rank)
        self.cp_ranks = _group_containing(self.groups.cp, self.rank)
        self.pp_ranks = _group_containing(self.groups.pp, self.rank)
        self.dp_ranks = _group_containing(self.groups.dp, self.rank)
        self.dp_cp_ranks = _group_containing(self.groups.dp_cp, self.rank)
        self.mp_ranks = _group_containing(self.groups.mp, self.rank)
        # Middle pipeline stages hold no word embedding: they are in no embedding group.
        self.embedding_ranks = next((g for g in self.groups.embedding if self.rank in g), [])
        self.tp_group = handles[("tp", tuple(self.tp_ranks))]
        self.pp_group = handles[("pp", tuple(self.pp_ranks))]
        self.dp_group = handles[("dp", tuple(self.dp_ranks))]
        self.cp_group = handles.get(("cp", tuple(self.cp_ranks)))
        self.dp_cp_group = handles.get(("dp_cp", tuple(self.dp_cp_ranks)), self.dp_group)
        self.mp_group = handles[("mp", tuple(self.mp_ranks))]
        self.embedding_group = handles.get(("embedding", tuple(self.embedding_ranks)))

    tp_size = property(lambda self: self.dims.tp_size)
    cp_size = property(lambda self: self.dims.cp_size)
    pp_size = property(lambda self: self.dims.pp_size)
    dp_size = property(lambda self: self.dims.dp_size)
    is_first_stage = property(lambda self: self.pp_rank == 0)
    is_last_stage = property(lambda self: self.pp_rank == self.dims.pp_size - 1)
    coords = property(lambda self: RankCoords(self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank))
    # The ranks among which one step's tokens are split (DP x CP: ``dims.data_shards``).
    data_shard_group = property(lambda self: self.dp_cp_group)

    @property
    def is_logging_rank(self) -> bool:
        """The rank that holds the loss and logs it: the last stage's first rank of every other dimension."""
        return self.is_last_stage and self.tp_rank == self.cp_rank == self.dp_rank == 0

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as Megatron's does)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def tp_src_rank(self) -> int:
        """Global rank that broadcasts data to its TP group (the group's first rank)."""
        return self.tp_ranks[0]

    @property
    def first_stage_rank(self) -> int:
        return self.pp_ranks[0]

    @property
    def last_stage_rank(self) -> int:
        return self.pp_ranks[-1]

    @property
    def in_embedding_group(self) -> bool:
        return self.is_first_stage or self.is_last_stage

    def named_groups(self) -> dict:
        """This rank's groups by name (what communication accounting reports bytes under); CP's only when CP > 1."""
        groups = {"tp": self.tp_group, "pp": self.pp_group, "dp": self.dp_group, "mp": self.mp_group,
                  "embedding": self.embedding_group}
        if self.cp_group is not None:
            groups.update(cp=self.cp_group, dp_cp=self.dp_cp_group)
        return groups

    def __repr__(self) -> str:
        d = self.dims
        cp = f", cp={self.cp_rank}/{d.cp_size}" if d.cp_size > 1 else ""
        return (
            f"Topology(rank={self.rank}, tp={self.tp_rank}/{d.tp_size}{cp}, dp={self.dp_rank}/{d.dp_size}, "
            f"pp={self.pp_rank}/{d.pp_size})"
        )


class DeepSpeedMPU:
    """The ``mpu`` DeepSpeed expects, over a Topology.

    DeepSpeed's "model parallel" is everything that holds different parameters (TP x PP): it reduces gradients
    over ``get_data_parallel_group`` (DP x CP: every rank that saw other tokens of the step; DP while CP is 1) and
    the grad norm over ``get_model_parallel_group``.
    """

    def __init__(self, topology: Topology):
        self.topology = topology

    def get_model_parallel_group(self):
        return self.topology.mp_group

    def get_model_parallel_world_size(self) -> int:
        return self.topology.dims.mp_size

    def get_model_parallel_rank(self) -> int:
        return self.topology.mp_ranks.index(self.topology.rank)

    def get_tensor_model_parallel_group(self):
        return self.topology.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.tp_rank

    def get_data_parallel_group(self):
        return self.topology.dp_cp_group

    def get_data_parallel_world_size(self) -> int:
        return self.topology.dims.dp_cp_size

    def get_data_parallel_rank(self) -> int:
        return self.topology.dp_cp_ranks.index(self.topology.rank)

    def get_pipeline_model_parallel_group(self):
        return self.topology.pp_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.topology.pp_size

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.topology.pp_rank

    # DeepSpeed's pipeline-aware code paths ask for these spellings.
    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_rank = get_tensor_model_parallel_rank


def describe(dims: ParallelDims, gpus_per_node: int) -> str:
    groups = build_rank_groups(dims)
    cp = f" x CP {dims.cp_size}" if dims.cp_size > 1 else ""
    lines = [
        f"world {dims.world_size} = TP {dims.tp_size}{cp} x DP {dims.dp_size} x PP {dims.pp_size}, "
        f"{gpus_per_node} GPUs per node"
    ]
    for kind, all_groups in groups.as_dict().items():
        lines.append(f"{kind:>9}: " + " ".join(str(g) for g in all_groups))
    lines.append("rank -> node, (tp, dp, pp):")
    for rank in range(dims.world_size):
        lines.append(f"  rank {rank:>4}: node {rank // gpus_per_node}, {dims.coords(rank)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print Megatron's process groups for a world size and TP/PP sizes.")
    p.add_argument("--world-size", type=int, required=True, help="total number of processes (GPUs)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (contiguous ranks)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size (pipeline stages)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="processes per node, to place ranks on nodes")
    p.add_argument("--json", action="store_true", help="print one JSON object: tp, pp, dp, mp, embedding")
    args = p.parse_args(argv)
    try:
        dims = ParallelDims(args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    except LayoutError as e:
        p.error(str(e))
    warn_if_tp_spans_nodes(dims, args.gpus_per_node)
    if args.json:
        print(json.dumps(build_rank_groups(dims).as_dict()))
    else:
        print(describe(dims, args.gpus_per_node))


if __name__ == "__main__":
    main()
