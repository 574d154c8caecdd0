"""The run's parallel dimensions and Megatron's rank order, as pure values (no process group).

One rank order, Megatron's tp-cp-dp-pp (the first varies fastest):

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

and the model-parallel rank that names a checkpoint's files, ``mp_rank = pp_rank * tp_size + tp_rank``
(``model_parallel_rank``). distributed/topology.py builds the process groups from these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from codegeex_train.layout.errors import LayoutError


def model_parallel_rank(tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """The model-parallel rank of a (TP, PP) coordinate: DeepSpeed's ``mp_rank_XX`` of the files it writes."""
    return pp_rank * tp_size + tp_rank


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel sizes, the named dimensions of the run. DP is derived: world = TP x CP x PP x DP.
    ``cp_size`` (context parallelism) has no flag yet: 1."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1

    def __post_init__(self) -> None:
        for flag, value in (
            ("--world-size", self.world_size),
            ("--tensor-model-parallel-size", self.tp_size),
            ("--pipeline-model-parallel-size", self.pp_size),
            ("--context-parallel-size", self.cp_size),
        ):
            if value < 1:
                raise LayoutError(f"{flag}={value}: must be >= 1")
        if self.world_size % self.non_data_parallel_size:
            cp = f" x context-parallel size {self.cp_size}" if self.cp_size > 1 else ""
            raise LayoutError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tp_size} x --pipeline-model-parallel-size {self.pp_size}{cp} = "
                f"{self.non_data_parallel_size}: change one of them or the number of processes"
            )

    @property
    def non_data_parallel_size(self) -> int:
        """TP x CP x PP: the ranks one data-parallel replica spans."""
        return self.tp_size * self.cp_size * self.pp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.non_data_parallel_size

    @property
    def dp_cp_size(self) -> int:
        """The ranks that see different tokens of one step: gradients and the loss are reduced over them."""
        return self.dp_size * self.cp_size

    data_shards = property(lambda self: self.dp_cp_size, doc="""The ranks among which one step's tokens are split (DP x
    CP), over which ZeRO partitions and the loss is averaged: what the loop and resume ask, whatever splits them.""")

    def describe(self) -> str:
        """'TP 2 x CP 1 x PP 2 x DP 1', as the logs and the dry run say it."""
        return f"TP {self.tp_size} x CP {self.cp_size} x PP {self.pp_size} x DP {self.dp_size}"

    @property
    def mp_size(self) -> int:
        """DeepSpeed's "model parallel": the ranks holding different parameters (TP x PP)."""
        return self.tp_size * self.pp_size

    def rank_coords(self, rank: int) -> RankCoords:
        """This rank's coordinate on every dimension (the tp-cp-dp-pp order)."""
        rank, tp_rank = divmod(rank, self.tp_size)
        rank, cp_rank = divmod(rank, self.cp_size)
        pp_rank, dp_rank = divmod(rank, self.dp_size)
        return RankCoords(tp_rank, cp_rank, dp_rank, pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        c = self.rank_coords(rank)
        return c.tp, c.dp, c.pp

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank


# A prime far above 100 x PP: no (stage, CP rank) pair repeats another's seed.
CP_SEED_STRIDE = 100_003


def rank_seed(seed: int, coords: RankCoords) -> int:
    """The seed of a rank's default random stream: the same on the ranks of a TP group (replicated dropout), other
    on every pipeline stage (Megatron's + 100 per stage, so stages do not repeat each other's masks) and on every CP
    rank (each holds other tokens of the sequence; CP rank 0 keeps the seed of a run without CP)."""
    return seed + 100 * coords.pp + CP_SEED_STRIDE * coords.cp


class RankCoords(NamedTuple):
    tp: int
    cp: int
    dp: int
    pp: int
