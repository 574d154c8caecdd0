"""tools/plot_metrics.py draws runs' metrics.jsonl into a PNG; MetricsLogger keeps its bar off non-terminals."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from codegeex_train.config.arguments import LoggingConfig
from codegeex_train.metrics import MetricsLogger
from tests.harness import load_tool

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

plot_metrics = load_tool("plot_metrics")


def train_record(iteration: int, loss: float, **extra) -> dict:
    return {"iteration": iteration, "split": "train", "consumed_samples": 8 * iteration, "lr": 1e-3 / iteration,
            "loss": loss, "grad_norm": 1.0 / iteration, "tokens_per_s": 1000.0 + iteration,
            "memory_gb": 0.5 + 0.01 * iteration, **extra}


def write_run(run_dir: Path, records: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    return run_dir


def small_run(run_dir: Path, scale: float = 1.0, comm: bool = True) -> Path:
    records = [{"iteration": 0, "split": "metadata", "cluster": {"nodes": []}}]
    for it in range(1, 9):
        extra = {"comm_tp_bytes": 4096.0 * scale, "comm_tp_bytes_theory": 4096.0 * scale,
                 "comm_dp_bytes": 1e6, "comm_pp_bytes": 0.0} if comm else {}  # pp: moves nothing, not drawn
        records.append(train_record(it, scale * (9.0 - 0.5 * it), **extra))
    records += [{"iteration": 4, "split": "valid", "valid_loss": 7.5, "valid_ppl": 1808.0},
                {"iteration": 8, "split": "valid", "valid_loss": 5.5, "valid_ppl": 244.7},
                {"iteration": 8, "split": "test", "test_loss": 5.6, "test_ppl": 270.4},
                {"iteration": 8, "split": "humaneval", "pass@1": 0.0}]
    return write_run(run_dir, records, tail='{"iteration": 9, "split": "tra')  # a crash's half-written line


def panel(fig, title: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title() == title]
    return ax


def legend_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_renders_a_png(tmp_path):
    run = small_run(tmp_path / "run")
    out = tmp_path / "plots" / "plots.png"
    assert plot_metrics.main([str(run), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 20_000


def test_panels_with_data_only(tmp_path):
    fig = plot_metrics.plot_runs([small_run(tmp_path / "run")])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "learning rate", "grad norm", "throughput", "memory", "communication"]
    assert legend_labels(panel(fig, "loss")) == ["run train", "run valid", "run test"]
    assert legend_labels(panel(fig, "communication")) == ["run tp", "run tp_theory", "run dp"]
    # No comm_* keys and no memory: those panels are left out.
    records = [{k: v for k, v in train_record(it, 5.0).items() if k != "memory_gb"} for it in (1, 2)]
    fig = plot_metrics.plot_runs([write_run(tmp_path / "bare", records)])
    assert [ax.get_title() for ax in fig.axes] == ["loss", "learning rate", "grad norm", "throughput"]


def test_overlays_two_runs_with_labels(tmp_path):
    a = small_run(tmp_path / "tp1")
    b = small_run(tmp_path / "tp2", scale=2.0, comm=False)
    fig = plot_metrics.plot_runs([a, b], labels=["TP 1", "TP 2"])
    assert legend_labels(panel(fig, "loss")) == ["TP 1 train", "TP 1 valid", "TP 1 test",
                                                 "TP 2 train", "TP 2 valid", "TP 2 test"]
    assert legend_labels(panel(fig, "learning rate")) == ["TP 1", "TP 2"]
    assert legend_labels(panel(fig, "communication")) == ["TP 1 tp", "TP 1 tp_theory", "TP 1 dp"]
    lines = panel(fig, "loss").get_lines()
    assert lines[0].get_color() != lines[3].get_color()  # one colour per run
    # Default labels: the directory names.
    fig = plot_metrics.plot_runs([a, b])
    assert legend_labels(panel(fig, "learning rate")) == ["tp1", "tp2"]


def test_communication_axis_spans_at_least_a_factor_two(tmp_path):
    # The default run's DP bytes and their theory differ by 16 bytes in 74 M: the axis must not zoom into that
    # sliver (its tick labels all read 7.41304e7).
    records = [train_record(it, 5.0, comm_dp_bytes=74130448.0, comm_dp_bytes_theory=74130432.0) for it in (1, 2)]
    low, high = panel(plot_metrics.plot_runs([write_run(tmp_path / "run", records)]), "communication").get_ylim()
    assert low <= 74130432.0 / 2 and high >= 74130448.0 * 2


def test_duplicate_iterations_take_the_last_record(tmp_path):
    # A run that crashed after iteration 3 and resumed from its iteration-2 checkpoint appends 3 and 4 again.
    records = [train_record(1, 9.0), train_record(2, 8.0), train_record(3, 100.0),
               train_record(3, 7.0), train_record(4, 6.0)]
    run = plot_metrics.load_run(write_run(tmp_path / "resumed", records))
    assert run.series("train", "loss") == ([1, 2, 3, 4], [9.0, 8.0, 7.0, 6.0])
    fig = plot_metrics.plot_runs([run])
    (line,) = panel(fig, "loss").get_lines()
    assert list(line.get_xdata()) == [1, 2, 3, 4] and list(line.get_ydata()) == [9.0, 8.0, 7.0, 6.0]


@pytest.mark.parametrize("case, says", [
    ("missing_dir", "no such directory"),
    ("missing_file", "no metrics.jsonl"),
    ("no_train", "no train records"),
    ("labels", "--labels: 1 labels for 2 runs"),
])
def test_bad_input_is_one_error_line(tmp_path, case, says):
    good = str(small_run(tmp_path / "good", comm=False))
    (tmp_path / "empty").mkdir()
    write_run(tmp_path / "eval_only", [{"iteration": 4, "split": "valid", "valid_loss": 7.5}])
    args = {"missing_dir": [str(tmp_path / "nope")], "missing_file": [str(tmp_path / "empty")],
            "no_train": [str(tmp_path / "eval_only")], "labels": [good, good, "--labels", "only-one"]}[case]
    out = tmp_path / "out.png"
    result = subprocess.run([sys.executable, str(TOOL), *args, "-o", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plot_metrics.py: error: ") and says in lines[0], result.stderr
    assert not out.exists()


def test_progress_bar_only_on_a_terminal(monkeypatch, capsys):
    cfg = LoggingConfig(progress_bar=True)
    logger = MetricsLogger(cfg, enabled=True, save_dir=None, run_config={}, train_iters=10)
    assert logger._bar is None  # pytest's captured stderr is not a TTY, as `| tee train.log` is not
    logger.advance(3)
    logger.log({"iteration": 3, "loss": 2.0})
    logger.close()
    captured = capsys.readouterr()
    assert "loss" in captured.out and "\r" not in captured.out + captured.err and "3/10" not in captured.err

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    logger = MetricsLogger(cfg, enabled=True, save_dir=None, run_config={}, train_iters=10)
    assert logger._bar is not None
    logger.advance(3)
    logger.close()
    assert "3/10" in capsys.readouterr().err
