"""benchmarks/pipeline.py: the bubble table end to end in its quick mode (p = 2, v = 1 and 2, sleeping stages on real
gloo ranks), and the interleaved section's runs are layouts training accepts. The one timing asserted is the point of
interleaving, with a 2x margin: v = 2 idles less than v = 1 at the same m."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from codegeex_train.config.arguments import parse_args, validate

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "pipeline.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("pipeline_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_bubble_table():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "bubble", "--quick"], check=False,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["p", "v", "m"])
    rows = {tuple(int(x) for x in words[:3]): [float(x) for x in words[3:]]
            for words in (line.split() for line in lines[header + 1:])}
    assert sorted(rows) == [(2, 1, 2), (2, 1, 4), (2, 2, 2), (2, 2, 4)]
    for (p, v, m), (ratio, theory, fraction, fraction_theory, step_ms, ideal_ms) in rows.items():
        assert theory == pytest.approx((p - 1) / (v * m), abs=1e-3)
        assert fraction_theory == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-3)
        assert ratio > 0.8 * theory and step_ms > 0.9 * ideal_ms  # p2p only adds
    for m in (2, 4):
        assert rows[2, 2, m][0] < rows[2, 1, m][0]


@pytest.mark.parametrize("quick", [False, True])
def test_interleaved_runs_are_layouts_training_accepts(quick):
    bench = _benchmark()
    shape = bench.QUICK_INTERLEAVED_SHAPE if quick else bench.INTERLEAVED_SHAPE
    for v in bench.CHUNKS:
        layout = validate(parse_args(bench.interleaved_args("data", "save", shape, v, 4)), 2)
        assert (layout.dims.pp_size, layout.num_chunks, layout.num_microbatches) == (2, v, 2)
