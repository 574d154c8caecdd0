"""Replay every rank's schedule against the pipeline's data dependencies: pure, no process group, no torch.

Rank r of p holds chunks c = 0 .. v-1 (virtual stage c·p + r). A step may start once the step before it on its
rank has finished and the steps it needs (on any rank) have finished:

    F(mb, c) on rank r   needs F(mb, c) on rank r - 1;  on rank 0 (c > 0): F(mb, c - 1) on rank p - 1
    B(mb, c) on rank r   needs its own F(mb, c) and B(mb, c) on rank r + 1;  on rank p - 1 (c < v - 1):
                         B(mb, c + 1) on rank 0;  the last virtual stage's B needs only its own F

Transfers are free and asynchronous (a send never waits for its receive), so the replay measures the schedule's
own bubble, not the network's. If no rank can go on while steps remain, the schedules deadlock
(``PipelineDeadlock`` names what each blocked rank waits for). A step missing from a rank counts the same way.

    idle_fraction = idle / (p · makespan)       1F1B: (p - 1)/(m + p - 1); interleaved: (p - 1)/(v·m + p - 1)
    bubble_ratio  = idle / busy                  Megatron's bubble time fraction: (p - 1)/m, (p - 1)/(v·m)

It lives next to the schedules (not in the tests) so the benchmark and the planner can state the schedule's
bubble and its activations in flight from the same replay the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

from codegeex_train.pipeline.schedules import Step


class PipelineDeadlock(RuntimeError):
    """No rank can run its next step, and some steps remain."""


@dataclass(frozen=True)
class Timeline:
    starts: list[list[float]]  # per rank, the start time of each of its steps, in schedule order
    ends: list[list[float]]
    busy: list[float]  # per rank, the time it computed
    makespan: float  # when the last step on any rank finished

    @property
    def idle(self) -> float:
        return len(self.busy) * self.makespan - sum(self.busy)

    @property
    def idle_fraction(self) -> float:
        """Idle share of all ranks' time from the first step to the last."""
        return self.idle / (len(self.busy) * self.makespan)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time (Megatron's "bubble time fraction" t_pb / t_id)."""
        return self.idle / sum(self.busy)


def dependencies(step: Step, rank: int, pp_size: int, num_chunks: int) -> list[tuple[int, Step]]:
    """The (rank, step) pairs ``step`` on ``rank`` needs finished before it may start."""
    p, v = pp_size, num_chunks
    if step.kind == "F":
        if rank > 0:
            return [(rank - 1, step)]
        return [(p - 1, Step("F", step.mb, step.chunk - 1))] if step.chunk > 0 else []
    needs = [(rank, Step("F", step.mb, step.chunk))]
    if rank < p - 1:
        needs.append((rank + 1, step))
    elif step.chunk < v - 1:
        needs.append((0, Step("B", step.mb, step.chunk + 1)))
    return needs


def simulate(schedules: list[list[Step]], forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Run ``schedules`` (rank r's steps at index r) as soon as the dependencies allow; each chunk's forward takes
    ``forward_time`` and its backward ``backward_time``. The number of chunks is read off the steps."""
    p = len(schedules)
    v = 1 + max((s.chunk for steps in schedules for s in steps), default=0)
    for rank, steps in enumerate(schedules):
        if len(set(steps)) != len(steps):
            raise ValueError(f"rank {rank}'s schedule repeats a step")
    duration = {"F": forward_time, "B": backward_time}
    done: dict[tuple[int, Step], float] = {}
    starts: list[list[float]] = [[] for _ in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]
    clock = [0.0] * p
    progress = True
    while progress:
        progress = False
        for rank, steps in enumerate(schedules):
            while len(ends[rank]) < len(steps):
                step = steps[len(ends[rank])]
                needs = dependencies(step, rank, p, v)
                if any(need not in done for need in needs):
                    break
                start = max([clock[rank]] + [done[need] for need in needs])
                clock[rank] = start + duration[step.kind]
                done[(rank, step)] = clock[rank]
                starts[rank].append(start)
                ends[rank].append(clock[rank])
                progress = True
    blocked = []
    for rank, steps in enumerate(schedules):
        if len(ends[rank]) < len(steps):
            step = steps[len(ends[rank])]
            waits = [need for need in dependencies(step, rank, p, v) if need not in done]
            blocked.append(f"rank {rank} at {step} waits for " + ", ".join(f"{s} on rank {r}" for r, s in waits))
    if blocked:
        raise PipelineDeadlock("the schedules deadlock: " + "; ".join(blocked))
    busy = [sum(duration[s.kind] for s in steps) for steps in schedules]
    return Timeline(starts, ends, busy, max((e[-1] for e in ends if e), default=0.0))


def peak_in_flight(steps: list[Step]) -> int:
    """Most (micro-batch, chunk) activations a rank holds at once: from a forward to its backward."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for step in steps:
        if step.kind == "F":
            live.add((step.mb, step.chunk))
            peak = max(peak, len(live))
        else:
            live.discard((step.mb, step.chunk))
    return peak
