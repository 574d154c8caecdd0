"""Ring attention against a dense single-process reference, on real gloo ranks.

One spawned run per CP size (the ``ring`` fixture): every rank builds the CP group, takes its load-balanced two chunks
of the same random full-sequence q, k, v and output gradient, and runs ``ring_attention`` forward and backward under
the accounting's CommCounter. Here the parent computes full-sequence causal attention with autograd (fp32) and
compares it with the ranks' outputs and gradients put back together by ``gather_from_context_parallel``. The same run
holds the cases that must fail (no load balancing, a merge without the log-sum-exp rescaling), the work per step,
dropout (masks captured in forward, checked replayed in backward, fed to the dense reference) and recompute; then
grouped-query attention (4 query heads over 2 or 1 key-value groups: K/V of the groups only on the ring) and the
sliding window, alone and together, against the dense reference with K/V repeated to the heads (head j on group
j // (n/g)) and the window's band. The block plan itself is checked with no process group: every causally visible
query-key pair computed exactly once, and under a window every block with no visible pair skipped.
"""

import math
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import codegeex_train.context_parallel.ring_attention as ra
from codegeex_train.accounting import CommCounter
from codegeex_train.context_parallel import (
    context_parallel_indices,
    gather_from_context_parallel,
    ring_attention_bytes,
    split_for_context_parallel,
)
from codegeex_train.context_parallel.ring_attention import ring_attention
from codegeex_train.tensor_parallel import MODEL_PARALLEL_RNG, RNGStatesTracker, recompute_activations
from tests.harness import run_distributed

B, HEADS, D = 2, 3, 8  # batch 2, several heads
CHUNK_LENS = (1, 3)  # c = s / 2N
NEGATIVE_C = 2  # the chunk length of the cases that must fail, the work count, dropout and recompute
DROPOUT = 0.3
FP32 = 4
TOLERANCE = 1e-6  # max abs, outputs and gradients


def full_inputs(s: int, seed: int) -> list[torch.Tensor]:
    """q, k, v and the output gradient of the whole sequence, (b, heads, s, d): the same in the ranks and here.

    Standard deviation 0.5: the tolerance is absolute, so the scale is part of the test. Over 100 seeds the ring and
    the fp32 reference then differ by at most 6e-7 (CP 4, c = 3); at std 1 fp32 rounding alone (of either side
    against fp64) reaches 1.6e-6."""
    g = torch.Generator().manual_seed(seed)
    return [0.5 * torch.randn(B, HEADS, s, D, generator=g) for _ in range(4)]


def dense_attention(q, k, v, dout, keep=None, dropout_p=0.0, window=None):
    """The reference: softmax(q k^T / sqrt(d) + causal) [dropped with ``keep``] v on the whole sequence, autograd.
    K/V of fewer heads than q (GQA) are repeated to them (head j reads group j // (n/g)); ``window``: query i sees
    keys i - window < j <= i only."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    repeat = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(repeat, dim=1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & ((i - j < window) if window is not None else True)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    out = probs @ v.repeat_interleave(repeat, dim=1)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


# --- In the ranks ------------------------------------------------------------------------------------------------

def _local(t, layout, r, n):
    return split_for_context_parallel(t, 2, r, n) if layout == "balanced" else t.chunk(n, dim=2)[r]


def _run(group, q, k, v, dout, **kwargs) -> dict:
    """Forward and backward of ring attention on local tensors; bytes each way on the CP group."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with CommCounter({"cp": group}) as comm:
        out = ring_attention(q, k, v, group, **kwargs)
        forward = comm.take().get("cp", 0)
        out.backward(dout)
        backward = comm.take().get("cp", 0)
    return {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad, "bytes": (forward, backward)}


def _work_per_step(group, q, k, v, balanced: bool) -> list[int]:
    """Query x key elements computed at each forward step (a step starts where the plan is asked for its block)."""
    steps, plan, compute = [], ra.ring_block, ra._block_forward

    def planned(*args):
        steps.append(0)
        return plan(*args)

    def computed(qb, kb, *args):
        steps[-1] += qb.shape[-2] * kb.shape[-2]
        return compute(qb, kb, *args)

    with mock.patch.object(ra, "ring_block", planned), mock.patch.object(ra, "_block_forward", computed), \
            torch.no_grad():
        ring_attention(q, k, v, group, balanced=balanced)
    return steps


def _order(group, q, k, v, dout) -> list[str]:
    """What forward and backward do, in order: "post" (an exchange posted), "forward" / "backward" (a block
    computed)."""
    events, post, forward, backward = [], ra._Ring.post, ra._block_forward, ra._block_backward

    def logged(name, fn):
        def run(*args):
            events.append(name)
            return fn(*args)
        return run

    with mock.patch.object(ra._Ring, "post", logged("post", post)), \
            mock.patch.object(ra, "_block_forward", logged("forward", forward)), \
            mock.patch.object(ra, "_block_backward", logged("backward", backward)):
        _run(group, q, k, v, dout)
    return events


def _tracker(seed: int) -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, seed)
    return tracker


def _dropout(group, r, n, q, k, v, dout) -> dict:
    """Ring attention with dropout; every keep mask drawn is captured. Returns the result, whether backward drew the
    forward's masks again, and this rank's rows of the global (b, heads, s, s) keep mask the forward used."""
    masks, draw = [], ra._dropout_keep

    def recorded(*args):
        masks.append(draw(*args))
        return masks[-1]

    with mock.patch.object(ra, "_dropout_keep", recorded):
        result = _run(group, q, k, v, dout, dropout_p=DROPOUT, rng_tracker=_tracker(100 + r))
    forward, backward = masks[:n], masks[n:]
    local_len, s = q.shape[2], q.shape[2] * n
    keep_rows = torch.ones(B, HEADS, local_len, s, dtype=torch.bool)
    for step, mask in enumerate(forward):  # balanced: one block per step, in step order
        j = (r - step) % n
        block = ra.ring_block(r, j, local_len)
        keep_rows[:, :, block.q][..., context_parallel_indices(s, j, n)[block.k]] = mask
    result["keep_rows"] = keep_rows
    result["replayed"] = len(backward) == n and all(torch.equal(a, b) for a, b in zip(forward, backward))
    result["dropped"] = float(1.0 - torch.cat([m.flatten() for m in forward]).float().mean())
    return result


def _recompute(group, r, q, k, v, dout) -> dict:
    """Under ``recompute_activations`` (forward run twice, RNG streams restored) the gradients are those of the plain run."""
    plain = _run(group, q, k, v, dout, dropout_p=DROPOUT, rng_tracker=_tracker(200 + r))
    tracker = _tracker(200 + r)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with CommCounter({"cp": group}) as comm:
        out = recompute_activations(lambda *qkv: ring_attention(*qkv, group, dropout_p=DROPOUT, rng_tracker=tracker),
                         tracker, q, k, v)
        forward = comm.take().get("cp", 0)
        out.backward(dout)
        backward = comm.take().get("cp", 0)
    again = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {"identical": all(torch.equal(plain[name], again[name]) for name in again),
            "bytes": (forward, backward)}


# name -> (query heads, key-value groups, window): GQA, the window, both, and one group with a window of 1 (only the
# diagonal: every block but the own one skipped)
OPTIONS = {"gqa": (4, 2, None), "window": (3, 3, 4), "gqa window": (4, 2, 4), "mqa window 1": (4, 1, 1)}
OPTIONS_C = 3


def option_inputs(name: str, s: int) -> list[torch.Tensor]:
    """q, k, v and the output gradient of ``OPTIONS[name]``: q and dout (b, heads, s, d), k and v (b, groups, s, d)."""
    heads, groups, _ = OPTIONS[name]
    g = torch.Generator().manual_seed(7)
    return [0.5 * torch.randn(B, n, s, D, generator=g) for n in (heads, groups, groups, heads)]


def _blocks_computed(group, q, k, v, window) -> int:
    calls, compute = [], ra._block_forward

    def counted(*args):
        calls.append(1)
        return compute(*args)

    with mock.patch.object(ra, "_block_forward", counted), torch.no_grad():
        ring_attention(q, k, v, group, window=window)
    return len(calls)


def ring_rank(topology) -> dict:
    group = dist.new_group(list(range(dist.get_world_size())))
    r, n = dist.get_rank(group), dist.get_world_size(group)
    results = {}
    for c in CHUNK_LENS:
        q, k, v, dout = (_local(t, "balanced", r, n) for t in full_inputs(2 * n * c, seed=c))
        results[f"exact c={c}"] = _run(group, q, k, v, dout)
    full = full_inputs(2 * n * NEGATIVE_C, seed=NEGATIVE_C)
    balanced = [_local(t, "balanced", r, n) for t in full]
    contiguous = [_local(t, "contiguous", r, n) for t in full]
    results["contiguous, balanced=False"] = _run(group, *contiguous, balanced=False)
    results["balanced slices, balanced=False"] = _run(group, *balanced, balanced=False)
    results["contiguous slices, balanced=True"] = _run(group, *contiguous)
    with mock.patch.object(ra, "_merge", lambda out, lse, block_out, block_lse: (out + block_out, lse)):
        results["merge without lse"] = _run(group, *balanced)
    results["work balanced"] = _work_per_step(group, *balanced[:3], balanced=True)
    results["work contiguous"] = _work_per_step(group, *contiguous[:3], balanced=False)
    results["order"] = _order(group, *balanced)
    results["dropout"] = _dropout(group, r, n, *balanced)
    results["recompute"] = _recompute(group, r, *balanced)
    for name, (_, _, window) in OPTIONS.items():
        local = [_local(t, "balanced", r, n) for t in option_inputs(name, 2 * n * OPTIONS_C)]
        results[name] = _run(group, *local, window=window)
        results[f"{name} blocks"] = _blocks_computed(group, *local[:3], window)
    return results


# --- Here ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def ring(request):
    n = request.param
    return n, run_distributed(ring_rank, world_size=n, deadline_s=240.0)


def _gathered(ranks, case, layout="balanced") -> dict:
    parts = {name: [torch.from_numpy(r[case][name]) for r in ranks] for name in ("out", "dq", "dk", "dv")}
    if layout == "balanced":
        return {name: gather_from_context_parallel(p, dim=2) for name, p in parts.items()}
    return {name: torch.cat(p, dim=2) for name, p in parts.items()}


def _max_diff(got: dict, want: dict) -> dict:
    return {name: float((got[name] - want[name]).abs().max()) for name in want}


def test_matches_dense_reference(ring):
    n, ranks = ring
    for c in CHUNK_LENS:
        diff = _max_diff(_gathered(ranks, f"exact c={c}"), dense_attention(*full_inputs(2 * n * c, seed=c)))
        assert max(diff.values()) <= TOLERANCE, (c, diff)


def test_bytes_equal_theory(ring):
    n, ranks = ring
    for c in CHUNK_LENS:
        want = ring_attention_bytes(B, HEADS, 2 * c, D, n, FP32)
        assert want.forward > 0 and want.backward > want.forward
        for r in ranks:
            assert tuple(r[f"exact c={c}"]["bytes"]) == tuple(want)
    # recompute runs the forward (and its ring) once more inside backward
    want = ring_attention_bytes(B, HEADS, 2 * NEGATIVE_C, D, n, FP32)
    for r in ranks:
        assert tuple(r["recompute"]["bytes"]) == (want.forward, want.forward + want.backward)


def test_without_load_balancing_the_comparison_fails(ring):
    n, ranks = ring
    want = dense_attention(*full_inputs(2 * n * NEGATIVE_C, seed=NEGATIVE_C))
    # the contiguous variant is right on its own layout: only the balance differs (next test) ...
    assert max(_max_diff(_gathered(ranks, "contiguous, balanced=False", "contiguous"), want).values()) <= TOLERANCE
    # ... but fed the balanced layout (the batch is split balanced, attention skips it), or the other way round, no
    for case, layout in (("balanced slices, balanced=False", "balanced"),
                         ("contiguous slices, balanced=True", "contiguous")):
        diff = _max_diff(_gathered(ranks, case, layout), want)
        assert diff["out"] > 1e-2 and diff["dk"] > 1e-2, (case, diff)


def test_merge_without_log_sum_exp_fails(ring):
    n, ranks = ring
    diff = _max_diff(_gathered(ranks, "merge without lse"), dense_attention(*full_inputs(2 * n * NEGATIVE_C,
                                                                                          seed=NEGATIVE_C)))
    assert diff["out"] > 1e-2 and diff["dq"] > 1e-2, diff


def test_work_per_step_is_balanced(ring):
    n, ranks = ring
    c, local = NEGATIVE_C, 2 * NEGATIVE_C
    balanced = np.array([r["work balanced"] for r in ranks])  # (rank, step)
    contiguous = np.array([r["work contiguous"] for r in ranks])
    assert balanced.shape == contiguous.shape == (n, n)
    # balanced: the own causal block (2c x 2c), then 2c x c at every step on every rank
    assert (balanced == np.array([4 * c * c] + [2 * c * c] * (n - 1))).all(), balanced
    # contiguous: at step i rank r computes 2c x 2c when the keys come from before it, nothing when from after
    assert (contiguous[:, 1:].min(axis=0) == 0).all() and (contiguous[:, 1:].max(axis=0) == local * local).all()
    assert len(set(contiguous.sum(axis=1))) == n  # total work differs on every rank
    assert balanced.sum() == contiguous.sum()  # the same work in all, spread evenly or not


def test_next_exchange_is_posted_before_each_block(ring):
    n, ranks = ring
    # forward: steps 0..N-2 post the next K/V first; backward: every step posts (K/V and / or the previous dK/dV
    # sum) before its block, then the last hop of dK/dV
    want = ["post", "forward"] * (n - 1) + ["forward"] + ["post", "backward"] * n + ["post"]
    assert all(r["order"] == want for r in ranks), ranks[0]["order"]


def test_dropout_matches_dense_reference_with_the_same_masks(ring):
    n, ranks = ring
    assert all(r["dropout"]["replayed"] for r in ranks), "backward must redraw the forward's masks"
    assert all(0.15 < r["dropout"]["dropped"] < 0.45 for r in ranks)
    keep = gather_from_context_parallel([torch.from_numpy(r["dropout"]["keep_rows"]) for r in ranks], dim=2)
    want = dense_attention(*full_inputs(2 * n * NEGATIVE_C, seed=NEGATIVE_C), keep=keep, dropout_p=DROPOUT)
    diff = _max_diff(_gathered(ranks, "dropout"), want)
    assert max(diff.values()) <= TOLERANCE, diff
    # and the masks matter: without them the reference is far off
    plain = dense_attention(*full_inputs(2 * n * NEGATIVE_C, seed=NEGATIVE_C))
    assert _max_diff(_gathered(ranks, "dropout"), plain)["out"] > 1e-2


def test_recompute_gives_identical_gradients(ring):
    _, ranks = ring
    assert all(r["recompute"]["identical"] for r in ranks)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_groups_and_window_match_dense_reference(ring, name):
    n, ranks = ring
    heads, groups, window = OPTIONS[name]
    diff = _max_diff(_gathered(ranks, name), dense_attention(*option_inputs(name, 2 * n * OPTIONS_C), window=window))
    assert max(diff.values()) <= TOLERANCE, diff
    assert ranks[0][name]["dk"].shape[1] == groups  # the ring carried the groups (and their gradients) only
    for r in ranks:  # each rank sent its groups' K/V, not the heads': the bytes of g heads
        assert tuple(r[name]["bytes"]) == tuple(ring_attention_bytes(B, groups, 2 * OPTIONS_C, D, n, FP32))
    if window is not None:  # and the comparison can tell: without the window the reference is far off
        plain = dense_attention(*option_inputs(name, 2 * n * OPTIONS_C))
        assert _max_diff(_gathered(ranks, name), plain)["out"] > 1e-2
    blocks = sum(r[f"{name} blocks"] for r in ranks)
    if window is not None and window <= OPTIONS_C:  # blocks outside the window skipped
        assert blocks < n * n, blocks
    if name == "mqa window 1":  # the diagonal only: each rank its own block
        assert blocks == n


# --- No process group ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("balanced", [True, False])
def test_block_plan_computes_every_visible_pair_once(n, c, balanced):
    s, local = 2 * n * c, 2 * c

    def held(rank):
        return context_parallel_indices(s, rank, n) if balanced else torch.arange(rank * local, (rank + 1) * local)

    covered = torch.zeros(s, s, dtype=torch.long)
    for r in range(n):
        for step in range(n):
            j = (r - step) % n
            block = ra.ring_block(r, j, local, balanced)
            if block is None:
                continue
            rows, cols = held(r)[block.q], held(j)[block.k]
            visible = cols[None, :] <= rows[:, None]  # the global causal mask on this block
            if block.causal:  # the local causal mask must be the global one
                assert torch.equal(visible, torch.ones(len(rows), len(cols), dtype=torch.bool).tril())
            else:
                assert visible.all(), (r, j, block)
            covered[rows[:, None], cols[None, :]] += visible.long()
    assert torch.equal(covered, torch.ones(s, s, dtype=torch.long).tril())


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("window", [1, 2, 3, 5, 9])
def test_window_plan_skips_exactly_the_blocks_outside_it(n, window):
    """Under a window a block is computed iff one of its queries sees one of its keys, with the global band as its
    mask; every visible pair is still computed exactly once."""
    c = 3
    s, local = 2 * n * c, 2 * c
    held = [context_parallel_indices(s, r, n) for r in range(n)]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    band = (j <= i) & (i - j < window)
    covered = torch.zeros(s, s, dtype=torch.long)
    for r in range(n):
        for step in range(n):
            kv = (r - step) % n
            block = ra.ring_block(r, kv, local)
            if block is None:
                continue
            rows, cols = held[r][block.q], held[kv][block.k]
            visible = band[rows[:, None], cols[None, :]]
            mask = ra._Window(window, n, local, True, torch.device("cpu")).mask(block, r, kv)
            assert (mask is None) == (not visible.any()), (r, kv)
            if mask is not None:
                assert torch.equal(mask, visible)
                covered[rows[:, None], cols[None, :]] += mask.long()
    assert torch.equal(covered, band.long())


def test_cp1_with_groups_and_window_is_sdpa():
    q, k, v, _ = option_inputs("gqa window", 12)
    want = dense_attention(q, k, v, torch.zeros_like(q), window=4)["out"]
    assert float((ring_attention(q, k, v, None, window=4) - want).abs().max()) <= TOLERANCE
    gqa = option_inputs("gqa", 12)
    assert float((ring_attention(*gqa[:3], None) - dense_attention(*gqa)["out"]).abs().max()) <= TOLERANCE


def test_cp1_is_todays_attention():
    q, k, v, _ = full_inputs(6, seed=0)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(ring_attention(q, k, v, None), want)
    trackers = [_tracker(5), _tracker(5)]
    with trackers[0].fork():
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.5)
    assert torch.equal(ring_attention(q, k, v, None, dropout_p=0.5, rng_tracker=trackers[1]), want)
    assert torch.equal(trackers[0].states[MODEL_PARALLEL_RNG], trackers[1].states[MODEL_PARALLEL_RNG])


def test_bytes_formula():
    # forward: N-1 hops of K and V; backward: N-1 of K and V and N of dK and dV
    kv = 2 * B * HEADS * 8 * D * FP32
    assert ring_attention_bytes(B, HEADS, 8, D, 4, FP32) == (3 * kv, 3 * kv + 4 * kv)
    assert ring_attention_bytes(B, HEADS, 8, D, 1, FP32) == (0, 0)
