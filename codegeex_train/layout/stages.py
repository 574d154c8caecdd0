"""Which transformer layers each pipeline stage holds. Pure: no process group.

Layers split evenly over the stages. When they do not divide, the user says how, Megatron-style:
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the first / last
stage's share and the remaining layers split evenly over the stages in between. A split that does not
add up is an error naming the flags, never a silent uneven one.

Interleaved 1F1B (``--num-layers-per-virtual-pipeline-stage N``, Megatron's flag): the layers are cut into p·v
virtual stages of N layers each (v = layers / (p·N) model chunks per rank), and rank r holds virtual stages
r, r + p, r + 2p, ... (``rank_chunk_layers``): e.g. 8 layers, p = 2, N = 2 -> rank 0 holds layers 0-1 and 4-5,
rank 1 layers 2-3 and 6-7. The embedding lives in rank 0's first chunk, the final LayerNorm, top query layer
and output layer in rank p-1's last chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from codegeex_train.layout.errors import LayoutError


def stage_layer_counts(num_layers: int, pp_size: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Number of transformer layers on each of ``pp_size`` stages."""
    flags = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
    if pp_size > num_layers:
        raise LayoutError(f"--pipeline-model-parallel-size {pp_size} is larger than --num-layers "
                          f"{num_layers}: every stage needs at least one layer")
    if pp_size == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise LayoutError(f"{flags} given with --pipeline-model-parallel-size 1: the one stage holds "
                              f"all {num_layers} layers; drop them")
        return [num_layers]
    for flag, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise LayoutError(f"{flag} {value}: every stage needs at least one layer")
    if first is None and last is None:
        if num_layers % pp_size:
            raise LayoutError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp_size}: "
                f"change one of them, or give the uneven split explicitly with {flags}")
        return [num_layers // pp_size] * pp_size
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    given = ", ".join(f"{f} {v}" for f, v in (("first", first), ("last", last)) if v is not None)
    if middle_stages == 0:
        if middle_layers != 0:
            raise LayoutError(f"{flags} ({given}) add up to {num_layers - middle_layers}, not --num-layers "
                              f"{num_layers}")
        return [first, last]
    if middle_layers < middle_stages or middle_layers % middle_stages:
        raise LayoutError(
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


def virtual_pipeline_size(num_layers: int, pp_size: int, layers_per_virtual_stage: int | None,
                          first: int | None = None, last: int | None = None) -> int:
    """v, the model chunks per rank, from ``--num-layers-per-virtual-pipeline-stage`` (None: 1, plain 1F1B)."""
    flag = "--num-layers-per-virtual-pipeline-stage"
    if layers_per_virtual_stage is None:
        return 1
    if layers_per_virtual_stage < 1:
        raise LayoutError(f"{flag} {layers_per_virtual_stage}: a virtual stage needs at least one layer")
    if pp_size == 1:
        raise LayoutError(f"{flag} {layers_per_virtual_stage} needs --pipeline-model-parallel-size > 1 "
                          f"(interleaving splits a pipeline's stages into chunks); drop it for PP 1")
    if first is not None or last is not None:
        raise LayoutError(f"{flag} splits the layers evenly into virtual stages: drop "
                          f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
    if num_layers % (pp_size * layers_per_virtual_stage):
        raise LayoutError(
            f"--num-layers {num_layers} is not divisible into --pipeline-model-parallel-size {pp_size} x {flag} "
            f"{layers_per_virtual_stage} = {pp_size * layers_per_virtual_stage} layers per round of chunks: choose "
            f"{flag} among {[n for n in range(1, num_layers // pp_size + 1) if num_layers % (pp_size * n) == 0]}")
    return num_layers // (pp_size * layers_per_virtual_stage)


def layers_per_virtual_stage(num_layers: int, pp_size: int, num_chunks: int) -> int | None:
    """``--num-layers-per-virtual-pipeline-stage`` N for v = ``num_chunks`` model chunks per rank (None for v 1):
    the inverse of ``virtual_pipeline_size``, for callers that think in v (the accounting, the planner)."""
    if num_chunks == 1:
        return None
    if num_chunks < 1 or num_layers % (pp_size * num_chunks):
        raise LayoutError(f"--num-layers {num_layers} is not divisible into --pipeline-model-parallel-size {pp_size} "
                          f"x {num_chunks} model chunks of equal layers: change the chunks per rank")
    return num_layers // (pp_size * num_chunks)


def rank_chunk_layers(num_layers: int, pp_size: int, num_chunks: int) -> list[tuple[range, ...]]:
    """Each pipeline rank's model chunks: ``[rank][chunk]`` -> global layer numbers; chunk c of rank r is virtual
    stage c·p + r. ``num_chunks`` 1: each rank's single range of ``stage_layer_ranges``' even split."""
    virtual = stage_layer_ranges(num_layers, pp_size * num_chunks)
    return [tuple(virtual[c * pp_size + r] for c in range(num_chunks)) for r in range(pp_size)]


def chunked_stage_layers(chunk_layers) -> tuple[tuple[int, ...], ...]:
    """Each rank's layers, all its chunks', in order: what its model (and its checkpoint file) holds."""
    return tuple(tuple(i for chunk in chunks for i in chunk) for chunks in chunk_layers)


def covers_each_layer_once(ranges: Sequence[Sequence[int]], num_layers: int) -> bool:
    """Whether the stages' layers are 0 .. num_layers - 1, each once: for ranges in O(stages), so that a run of
    --num-layers 10**9 is refused by the memory check instead of listing its layers."""
    if all(isinstance(r, range) and r.step == 1 for r in ranges):
        end = 0
        for r in sorted((r for r in ranges if len(r)), key=lambda r: r.start):
            if r.start != end:
                return False
            end = r.stop
        return end == num_layers
    return sorted(i for r in ranges for i in r) == list(range(num_layers))
