"""Which transformer layers each pipeline stage holds. Pure: no process group.

Layers split evenly over the stages. When they do not divide, the user says how, Megatron-style:
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the first / last
stage's share and the remaining layers split evenly over the stages in between. A split that does not
add up is an error naming the flags, never a silent uneven one.
"""

from __future__ import annotations


class PipelineSplitError(ValueError):
    """A layer split that cannot work; the message names the flags and the fix."""


def stage_layer_counts(num_layers: int, pp_size: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Number of transformer layers on each of ``pp_size`` stages."""
    flags = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
    if pp_size > num_layers:
        raise PipelineSplitError(f"--pipeline-model-parallel-size {pp_size} is larger than --num-layers "
                                 f"{num_layers}: every stage needs at least one layer")
    if pp_size == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise PipelineSplitError(f"{flags} given with --pipeline-model-parallel-size 1: the one stage holds "
                                     f"all {num_layers} layers; drop them")
        return [num_layers]
    for flag, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise PipelineSplitError(f"{flag} {value}: every stage needs at least one layer")
    if first is None and last is None:
        if num_layers % pp_size:
            raise PipelineSplitError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp_size}: "
                f"change one of them, or give the uneven split explicitly with {flags}")
        return [num_layers // pp_size] * pp_size
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    given = ", ".join(f"{f} {v}" for f, v in (("first", first), ("last", last)) if v is not None)
    if middle_stages == 0:
        if middle_layers != 0:
            raise PipelineSplitError(f"{flags} ({given}) add up to {num_layers - middle_layers}, not --num-layers "
                                     f"{num_layers}")
        return [first, last]
    if middle_layers < middle_stages or middle_layers % middle_stages:
        raise PipelineSplitError(
            f"{flags} ({given}) leave {middle_layers} of --num-layers {num_layers} for the other {middle_stages} "
            f"stage(s): that must be a positive multiple of {middle_stages}")
    each = middle_layers // middle_stages
    counts = [each] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layer_ranges(num_layers: int, pp_size: int, first: int | None = None,
                       last: int | None = None) -> list[range]:
    """Global layer numbers of each stage, e.g. 10 layers, PP 3, first 2 -> [0..1], [2..5], [6..9]."""
    ranges, start = [], 0
    for count in stage_layer_counts(num_layers, pp_size, first, last):
        ranges.append(range(start, start + count))
        start += count
    return ranges
