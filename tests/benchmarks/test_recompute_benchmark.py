"""benchmarks/recompute.py end to end at a tiny shape (1 layer + the top query layer, hidden 64, 4 heads, seq 128,
dropout 0.1 so that CPU SDPA keeps its s x s probabilities): every row of the table is printed and written, and the
memory the recompute modes and sequence parallelism exist for is really saved. Timings are never asserted.
The script's main() runs in this process (its ranks come from this process's warm forkserver, as every distributed
test's do): the command line it parses and everything it prints and writes, without a second interpreter importing
torch and DeepSpeed again."""

import contextlib
import importlib
import io
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

# Written out here (not imported from the script): a row that vanishes from the script fails this test.
RECOMPUTES = ("none", "selective core_attn", "selective all three", "full")
EXPECTED_ROWS = [(name, sp) for sp in (False, True) for name in RECOMPUTES]
B, S, H, FFN, TP, MLPS = 2, 128, 64, 256, 2, 2  # the MLPs: the layer's and the top query layer's


def run_benchmark(out: Path):
    """``python benchmarks/recompute.py ... --json OUT``, in this process: (stdout, the JSON, its rows by key)."""
    script = importlib.import_module("benchmarks.recompute")  # by name: its ranks unpickle bench_rank from it
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        script.main(["--num-layers", "1", "--hidden-size", str(H), "--num-attention-heads", "4", "--seq-length",
                     str(S), "--micro-batch-size", str(B), "--warmup-iters", "0", "--iters", "1", "--json", str(out)])
    assert out.is_file(), stdout.getvalue()[-4000:]
    report = json.loads(out.read_text())
    return stdout.getvalue(), report, {(r["recompute"], r["sp"]): r for r in report["rows"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_benchmark(tmp_path_factory.mktemp("recompute") / "recompute.json")


def test_every_row_is_printed_and_written(run):
    stdout, report, _ = run
    assert [(r["recompute"], r["sp"]) for r in report["rows"]] == EXPECTED_ROWS
    table = stdout[stdout.index("\nrecompute and sequence parallelism, TP 2"):]  # ONE table, at the end
    lines = [line.split() for line in table.splitlines()]
    for name, sp in EXPECTED_ROWS:
        words = name.split() + ["on" if sp else "off"]
        assert sum(line[:len(words)] == words for line in lines) == 1, (name, sp, table)
    assert "SP on / off" in table and "math path, s x s kept" in stdout
    for r in report["rows"]:
        assert r["tokens_per_s"] > 0 and r["saved_bytes"] > 0 and r["peak_tensor_bytes"] > 0
        if r["recompute"] == "none":  # its own baseline
            assert (r["overhead"], r["saved_vs_none"], r["max_loss_diff_vs_none"]) == (0.0, 1.0, 0.0)


def test_recompute_and_sp_save_memory_and_change_no_loss(run):
    _, _, rows = run
    for sp in (False, True):
        none, core, full = (rows[(name, sp)] for name in ("none", "selective core_attn", "full"))
        # The s x s probabilities, their dropout mask and the dropped ones are most of what "none" keeps here
        # (measured: selective keeps 0.54-0.60 of it); full recompute keeps only each layer's input.
        assert core["saved_bytes"] < 0.8 * none["saved_bytes"]
        assert core["peak_tensor_bytes"] < none["peak_tensor_bytes"]
        assert full["saved_bytes"] < core["saved_bytes"]
        for name in RECOMPUTES:  # recompute restores the dropout masks: the same losses
            assert rows[(name, sp)]["max_loss_diff_vs_none"] <= 1e-5 * abs(none["losses"][0])
    for name in RECOMPUTES:  # SP splits the LayerNorm / dropout / residual activations over the TP ranks
        assert rows[(name, True)]["saved_bytes"] < rows[(name, False)]["saved_bytes"]


def test_mlp_act_and_layernorm_recompute_save_exactly_their_outputs(run):
    """"all three" keeps, beyond core_attn, neither the MLP activation's output (b, s, ffn/tp) nor the two LayerNorm
    outputs of each layer ((b, s, h), or (b, s/tp, h) under SP), and nothing else changes."""
    _, _, rows = run
    for sp in (False, True):
        mlp_act = MLPS * B * S * FFN // TP * 4  # fp32
        layernorm = 2 * MLPS * B * (S // TP if sp else S) * H * 4
        saved = rows[("selective core_attn", sp)]["saved_bytes"] - rows[("selective all three", sp)]["saved_bytes"]
        assert saved == mlp_act + layernorm, (sp, saved, mlp_act, layernorm)


def test_mlp_act_and_layernorm_recompute_lower_the_peak(run, tmp_path):
    """What SavedActivations counts as not saved must also be freed: the peak of live tensor memory drops by at least
    half of the outputs "all three" recomputes beyond core_attn (measured with the target freed: 0.75-1.2x). Without
    SP only: with it the peak sits where gloo's background allocations land and moved by a run-to-run 0-0.3 MB
    (tests/tensor_parallel/test_recompute.py checks the freeing itself, deterministically)."""
    _, _, rows = run
    sp = False
    recomputed = MLPS * B * S * FFN // TP * 4 + 2 * MLPS * B * (S // TP if sp else S) * H * 4

    def drop(rows):
        return rows[("selective core_attn", sp)]["peak_tensor_bytes"] - rows[("selective all three", sp)][
            "peak_tensor_bytes"]

    # One profiled iteration per variant: a background allocation (gloo, DeepSpeed) landing on one variant's peak
    # can hide the drop (seen twice in CI runs, 0.38x, once in a first run and its rerun alike: the suite's other
    # worker loading the cores). Noise only adds bytes, so the best of up to three runs decides.
    drops = [drop(rows)]
    while max(drops) < recomputed / 2 and len(drops) < 3:
        drops.append(drop(run_benchmark(tmp_path / f"again{len(drops)}.json")[2]))
    assert max(drops) >= recomputed / 2, (sp, drops, recomputed)
