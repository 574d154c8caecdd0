"""benchmarks/gpu.py (the prepared GPU check) end to end on CPU with --device cpu --smoke: every section runs in a
process of its own, the one table at the end holds every row (printed, and in the JSON and Markdown files), and a
section that raises, runs out of memory or hangs shows up as error / retried / timeout rows while the others still
run. No GPU here: the shapes are tiny, and fp16 runs on the CPU (forced where DeepSpeed refuses it, i.e. on a CPU
without AVX-512 FP16 / AMX)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
# Written out here (not imported from the script): a row that vanishes from the script fails this test.
EXPECTED_ROWS = ("a.max_rel_diff", "a.final_loss", "b.skipped", "b.loss_scale", "b.applied",
                 "c.tokens_per_s", "c.mfu", "c-recompute.tokens_per_s", "c-recompute.mfu",
                 "d.ours", "d.hf", "d.ratio", "d.greedy")


def gpu_check(out: Path, *args: str, timeout: float = 420.0) -> tuple[subprocess.CompletedProcess, dict]:
    # The script runs each section in its own session and takes it down on SIGTERM/SIGINT; subprocess.run's timeout
    # sends SIGKILL to the script only, so every section also has its own budget (60 s in --smoke).
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--output-dir", str(out), *args],
                          check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert (out / "gpu_check.json").is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads((out / "gpu_check.json").read_text())


def printed_table(stdout: str) -> str:
    start = stdout.index("\ncheck ")
    return stdout[start:stdout.index("\nwritten: ")]


def test_smoke_run_reports_every_row(tmp_path):
    proc, report = gpu_check(tmp_path)
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    keys = [r["key"] for r in report["rows"]]
    assert keys == list(EXPECTED_ROWS), output
    rows = {r["key"]: r for r in report["rows"]}
    bad = {k: (r["status"], r["note"]) for k, r in rows.items() if r["status"] in ("error", "timeout", "FAIL",
                                                                                     "skipped")}
    assert not bad, output
    assert proc.returncode == 0, output

    table = printed_table(proc.stdout)  # ONE table, at the end of the output, with every check
    assert table.count("\n(") == len(EXPECTED_ROWS)
    for r in report["rows"]:
        assert r["check"] in table and r["status"] in ("pass", "info", "below bar")
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert sum(line.startswith("| (") for line in markdown.splitlines()) == len(EXPECTED_ROWS)

    units = report["units"]
    for unit in ("a", "b", "c", "c-recompute", "d"):  # each a torch.distributed world of one, gloo on CPU
        assert units[unit]["backend"] == "gloo" and units[unit]["rc"] == 0 and units[unit]["done"]
        assert (tmp_path / units[unit]["log"]).is_file()
    a = units["a"]["data"]
    assert (a["fp32_weights"], a["bf16_weights"]) == ("float32", "bfloat16")  # two precisions, truly
    assert len(a["fp32_losses"]) == len(a["bf16_losses"]) == a["iters_planned"]
    assert a["fp32_losses"] != a["bf16_losses"]
    b = units["b"]["data"]
    assert b["weights"] == "float16" and "cpu_fp16" in b  # natively where the CPU has fp16, else forced
    steps = b["steps"]
    assert steps[0]["skipped"] and not all(s["skipped"] for s in steps)  # overflows first, then steps apply
    assert steps[0]["scale"] == 2.0 ** b["initial_scale_power"] and b["final_scale"] < steps[0]["scale"]
    c, cr = units["c"]["data"], units["c-recompute"]["data"]
    assert c["weights"] == cr["weights"] == "bfloat16"
    assert c["mfu_with_recompute_flops"] == c["mfu"] and cr["mfu_with_recompute_flops"] > cr["mfu"]
    d = units["d"]["data"]
    assert d["rows_identical"] == d["batch"] and d["lengths_ok"]  # fp32: ours and HF generate agree exactly


def test_a_failing_section_is_a_row_and_the_others_still_run(tmp_path):
    # One timed (c) iteration and no warm-up: only the retry's having run is checked here.
    proc, report = gpu_check(tmp_path, "--sections", "c", "d", "--inject-error", "c", "--inject-oom", "c-recompute",
                             "--inject-hang", "d", "--budget", "d=10", "--c-warmup-iters", "0", "--c-iters", "1")
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 1, output
    rows = {r["key"]: r for r in report["rows"]}
    assert list(rows) == ["c.tokens_per_s", "c.mfu", "c-recompute.tokens_per_s", "c-recompute.mfu",
                          "d.ours", "d.hf", "d.ratio", "d.greedy"], output
    for key in ("c.tokens_per_s", "c.mfu"):  # raised: error rows carrying the exception
        assert rows[key]["status"] == "error" and "injected failure" in rows[key]["note"]
    for key in ("d.ours", "d.hf", "d.ratio", "d.greedy"):  # hung: killed at its budget
        assert rows[key]["status"] == "timeout" and "budget" in rows[key]["note"]
    # out of memory at micro-batch 2: retried once at 1, which ran (and says so)
    assert rows["c-recompute.tokens_per_s"]["status"] == "info"
    assert "retried after OOM at micro-batch 2" in rows["c-recompute.tokens_per_s"]["note"]
    assert report["units"]["c-recompute"]["data"]["micro_batch_size"] == 1
    table = printed_table(proc.stdout)
    assert table.count(" error ") == 2 and table.count(" timeout ") == 4
