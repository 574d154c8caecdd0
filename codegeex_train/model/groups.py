"""The process groups a model's layers communicate over, as one value (megatron-core's ``ProcessGroupCollection``,
the model's part).

    groups = ModelGroups.from_topology(topology)    # this rank's TP group, and its CP group under CP
    model = CodeGeeXModel(config, groups, plan, tracker)

The bundle is passed down the constructors (model -> layers -> attention, MLP) and each layer takes from it the
group it uses; the plan (layout/plan.py) says what runs over them (sequence parallelism, context parallelism,
recompute). ``check`` ties the two together once, in the model: the groups' sizes are the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.tensor_parallel.mappings import ProcessGroup, group_rank, group_size

if TYPE_CHECKING:
    from codegeex_train.distributed.topology import Topology


@dataclass(frozen=True)
class ModelGroups:
    """``tp``: tensor parallelism (heads, FFN columns, vocab rows; under SP the sequence between them) and ``cp``:
    context parallelism (the ring of ring attention), None without CP. None for a group: one rank, nothing to
    communicate (``ModelGroups()`` is a single-rank model)."""

    tp: ProcessGroup | None = None
    cp: ProcessGroup | None = None

    @classmethod
    def from_topology(cls, topology: Topology) -> ModelGroups:
        return cls(tp=topology.tp_group, cp=topology.cp_group)  # cp_group is None at CP 1

    tp_size = property(lambda self: group_size(self.tp))
    tp_rank = property(lambda self: group_rank(self.tp))
    cp_size = property(lambda self: group_size(self.cp))
    cp_rank = property(lambda self: group_rank(self.cp))

    def sequence_parallel_group(self, plan: ParallelPlan) -> ProcessGroup | None:
        """The group sequence parallelism splits the residual stream over: TP's when the plan has SP in effect."""
        return self.tp if plan.sp else None

    def check_whole_sequences(self, what: str) -> None:
        """ValueError unless each rank holds whole sequences (no CP group), which ``what`` needs."""
        if self.cp is not None:
            raise ValueError(f"{what} runs whole sequences: build the model without context parallelism")

    def check(self, plan: ParallelPlan) -> None:
        """Raise ValueError unless these are the plan's groups: its TP size, and a CP group exactly when it has
        CP (of its size), so that a layer may read "CP is on" from ``cp`` not being None."""
        if (self.tp_size, self.cp_size) != (plan.tp_size, plan.cp_size) or (self.cp is None) != (plan.cp_size == 1):
            cp = "no CP group" if self.cp is None else f"a CP group of {self.cp_size}"
            raise ValueError(f"the model's groups (a TP group of {self.tp_size}, {cp}) are not the plan's "
                             f"(TP {plan.tp_size}, CP {plan.cp_size}): build them for the same layout "
                             f"(ModelGroups.from_topology)")
