"""benchmarks/checkpoint.py end to end at a tiny shape (1 layer + the top query layer, hidden 64): both rows of the
table and the CodeGeeX-13B projection are printed and written, every save was committed, and the bytes attributed
to each rank are the files that rank writes (the ZeRO partition on both, the model file on DP rank 0), against the
parameter count. Timings are never asserted. The projection is checked against CodeGeeX-13B's shapes written out
here."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "checkpoint.py"
H, LAYERS, V, S = 64, 1, 1024, 32


def _benchmark():
    spec = importlib.util.spec_from_file_location("checkpoint_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _parameters(h: int, layers: int, vocab: int, positions: int, tp: int = 1) -> int:
    """One TP rank's parameters of our model with the top query layer (fast GeLU MLP of 4h), written out: per layer
    (the top query layer alike) Q/K/V, dense, h -> 4h, 4h -> h split over TP with their column biases, two LayerNorms
    and the row-parallel biases replicated; the word table split, the position and top query tables replicated."""
    split = 3 * h * h + 3 * h + h * h + h * 4 * h + 4 * h + 4 * h * h
    replicated = 2 * 2 * h + 2 * h
    return (layers + 1) * (split // tp + replicated) + vocab * h // tp + 2 * positions * h + 2 * h


def test_every_row_is_printed_and_bytes_are_each_ranks_files(tmp_path):
    out = tmp_path / "checkpoint.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--num-layers", str(LAYERS), "--hidden-size", str(H),
                           "--num-attention-heads", "4", "--seq-length", str(S), "--rounds", "1", "--save-every", "2",
                           "--warmup-iters", "1", "--save-dir", str(tmp_path / "save"), "--json", str(out)],
                          check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    table = proc.stdout[proc.stdout.index("\ncheckpoint saves, sync against async"):]
    lines = [line.split() for line in table.splitlines()]
    for mode in ("sync", "async"):
        assert sum(line[:2] == [mode, "1"] for line in lines) == 1, (mode, table)
    assert "async stall / sync stall:" in table
    for gpus in ("64", "512", "1536"):
        assert sum(line[:1] == [gpus] for line in lines) == 1, (gpus, table)
    # The last cycle's tag is the one 'latest' names (the benchmark checked each commit); older tags were removed.
    assert (tmp_path / "save" / "latest").read_text().strip() == "iter_0000004"
    assert sorted(p.name for p in (tmp_path / "save").iterdir() if p.name.startswith("iter_")) == ["iter_0000004"]

    params = _parameters(H, LAYERS, V, S)
    assert report["parameters"] == params
    shard = -(-params // 2)
    for row in report["rows"]:
        rank0, rank1 = row["bytes_per_rank"]
        # Each ZeRO file: the fp32 master partition and two Adam moments, plus DeepSpeed's metadata (slice maps).
        assert 12 * shard <= rank1 <= 12 * shard + 256 * 1024, (row["mode"], rank1, 12 * shard)
        # DP rank 0 also writes the model file: the fp32 weights, all of them.
        assert 4 * params <= rank0 - rank1 <= 4 * params + 256 * 1024, (row["mode"], rank0 - rank1, 4 * params)
        assert all(w > 0 for w in row["write_s"]) and row["stall_s"] > 0 and row["gbps_total"] > 0
    assert report["rows"][0]["after_s"] == 0.0  # sync: nothing happens after the save step
    assert report["async_over_sync_stall"] == pytest.approx(report["rows"][1]["stall_s"] / report["rows"][0]["stall_s"])


def test_codegeex_13b_projection_is_the_presets_bytes():
    """~14 bytes per parameter: the weights' 2 by DP rank 0 of each TP rank, the 12 of master and moments over DP."""
    bench = _benchmark()
    psi = _parameters(5120, 39, 52224, 2048, tp=8)
    rows = bench.projection(2.0)
    assert [r["gpus"] for r in rows] == [64, 512, 1536]
    for r in rows:
        dp = r["gpus"] // 8
        assert r["dp"] == dp
        assert r["other_rank_bytes"] == 12 * -(-psi // dp)
        assert r["busiest_rank_bytes"] == 2 * psi + 12 * -(-psi // dp)
        assert r["total_bytes"] == 8 * (2 * psi + dp * 12 * -(-psi // dp))
        assert r["busiest_rank_s"] == pytest.approx(r["busiest_rank_bytes"] / 2e9)
    assert 180e9 < rows[0]["total_bytes"] < 185e9  # the issue's ~180 GB
