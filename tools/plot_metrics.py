#!/usr/bin/env python
"""Plot one or more training runs from their ``metrics.jsonl``.

    python tools/plot_metrics.py outputs/codegen-default -o plots.png
    python tools/plot_metrics.py outputs/tp1 outputs/tp2 -o tp.png --labels "TP 1" "TP 2"

Each RUN_DIR is a ``--save`` directory holding ``metrics.jsonl`` (or the path of a metrics file itself). The
figure is a grid of panels, one per quantity that has data: loss (train as a line, validation and test as
markers), learning rate, grad norm, tokens/s, memory (GB) and communication (every ``comm_*`` key, bytes per
step; keys naming a theoretical value, ``*theory*`` / ``*expected*``, dashed). Runs are overlaid, one colour
per run, labelled by ``--labels`` or the directory name. A resumed run appends to its metrics file, so an
iteration may appear more than once: the last record of each (split, iteration) is the one plotted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from codegeex_train.bounded_read import FileReadError, decode_utf8, read_lines

PROG = "plot_metrics.py"
METRICS_FILE = "metrics.jsonl"
MAX_METRICS_BYTES = 4 << 30  # the most read of one metrics file: a record per logged step, under 1 KiB each

# (key in "train" records, panel title, y label); loss and communication are drawn separately.
SIMPLE_PANELS = (
    ("lr", "learning rate", "lr"),
    ("grad_norm", "grad norm", "grad norm"),
    ("tokens_per_s", "throughput", "tokens/s"),
    ("memory_gb", "memory", "GB (peak)"),
)
EVAL_SPLITS = ("valid", "test")


class MetricsError(Exception):
    """Bad input: reported as one ``plot_metrics.py: error: ...`` line."""


class Run:
    """One run's records by split, each a list sorted by iteration (the last record of each iteration)."""

    # A plain class, not a dataclass: load_tool() runs this file without registering it in sys.modules.
    def __init__(self, label: str, path: Path, splits: dict[str, list[dict]]) -> None:
        self.label = label
        self.path = path
        self.splits = splits

    def records(self, split: str) -> list[dict]:
        return self.splits.get(split, [])

    def series(self, split: str, key: str) -> tuple[list[int], list[float]]:
        """(iterations, values) of ``key`` in ``split`` records that have a number for it."""
        xs, ys = [], []
        for record in self.records(split):
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                xs.append(record["iteration"])
                ys.append(float(value))
        return xs, ys


def metrics_path(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
        if not path.is_file():
            raise MetricsError(f"{run_dir}: no {METRICS_FILE} in this directory")
    elif not path.exists():
        raise MetricsError(f"{run_dir}: no such directory")
    return path


def load_run(run_dir: str | Path, label: str | None = None) -> Run:
    """Read ``RUN_DIR/metrics.jsonl``; later records of a (split, iteration) replace earlier ones. A line that
    is not a JSON object with an integer ``iteration`` (e.g. the half-written last line of a crashed run) is
    skipped. Raises MetricsError when the file is missing or has no train records."""
    path = metrics_path(run_dir)
    by_split: dict[str, dict[int, dict]] = {}
    try:
        for number, raw in read_lines(path, MAX_METRICS_BYTES):
            line = decode_utf8(raw, f"{path}:{number}").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                continue
            if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
                continue
            split = record.get("split", "train")
            if isinstance(split, str):
                by_split.setdefault(split, {})[record["iteration"]] = record
    except FileReadError as e:  # not a regular file, over the bound, not UTF-8
        raise MetricsError(str(e)) from None
    if not by_split.get("train"):
        raise MetricsError(f"{path}: no train records")
    if label is None:
        label = (path.parent if path.name == METRICS_FILE else path).resolve().name
    return Run(label=label, path=path,
               splits={split: [records[i] for i in sorted(records)] for split, records in by_split.items()})


def _comm_keys(runs: list[Run]) -> list[str]:
    keys: dict[str, None] = {}
    for run in runs:
        for record in run.records("train"):
            for key, value in record.items():
                if key.startswith("comm_") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    keys.setdefault(key)
    return list(keys)


def _is_theory(key: str) -> bool:
    return "theory" in key or "expected" in key


def plot_runs(runs, labels: list[str] | None = None):
    """A matplotlib Figure of ``runs`` (Run objects or run directories) overlaid. ``labels`` replace the run
    labels (one per run). Every panel has a legend; its title is the panel's ``Axes.get_title()``."""
    try:
        import matplotlib
    except ImportError:
        raise MetricsError("matplotlib is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg")  # non-interactive: files only, no display needed
    import matplotlib.pyplot as plt

    runs = [run if isinstance(run, Run) else load_run(run) for run in runs]
    if not runs:
        raise MetricsError("no runs to plot")
    if labels is not None:
        if len(labels) != len(runs):
            raise MetricsError(f"--labels: {len(labels)} labels for {len(runs)} runs")
        runs = [Run(label=label, path=run.path, splits=run.splits) for run, label in zip(runs, labels)]
    colours = [f"C{i % 10}" for i in range(len(runs))]

    # Each panel: (title, y label, draw(ax) -> whether it drew anything).
    panels = []

    def draw_loss(ax) -> bool:
        drew = False
        for run, colour in zip(runs, colours):
            xs, ys = run.series("train", "loss")
            if xs:
                ax.plot(xs, ys, color=colour, label=f"{run.label} train")
                drew = True
            for split, marker in zip(EVAL_SPLITS, ("o", "s")):
                xs, ys = run.series(split, f"{split}_loss")
                if xs:
                    ax.plot(xs, ys, color=colour, linestyle="--", marker=marker, markersize=4,
                            label=f"{run.label} {split}")
                    drew = True
        return drew

    panels.append(("loss", "loss", draw_loss))

    def simple(key):
        def draw(ax) -> bool:
            drew = False
            for run, colour in zip(runs, colours):
                xs, ys = run.series("train", key)
                if xs:
                    ax.plot(xs, ys, color=colour, label=run.label)
                    drew = True
            return drew
        return draw

    for key, title, ylabel in SIMPLE_PANELS:
        panels.append((title, ylabel, simple(key)))

    comm_keys = _comm_keys(runs)

    def draw_comm(ax) -> bool:
        drew, finite = False, []
        styles = ("-", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
        measured = [k for k in comm_keys if not _is_theory(k)]
        for run, colour in zip(runs, colours):
            for key in comm_keys:
                xs, ys = run.series("train", key)
                if not xs or not any(ys):  # a group that moves nothing in this layout (e.g. TP at TP 1)
                    continue
                style = "--" if _is_theory(key) else styles[measured.index(key) % len(styles)]
                name = key.removeprefix("comm_").replace("_bytes", "")
                ax.plot(xs, ys, color=colour, linestyle=style, label=f"{run.label} {name}")
                finite.extend(y for y in ys if math.isfinite(y))
                drew = True
        if finite and min(finite) > 0:
            ax.set_yscale("log")  # groups differ by orders of magnitude
            # At least a factor 2 either side: measured and theory a few bytes apart would otherwise zoom the axis
            # into a sliver whose tick labels all read the same number.
            ax.set_ylim(min(finite) / 2, max(finite) * 2)
        return drew

    if comm_keys:
        panels.append(("communication", "bytes / step", draw_comm))

    # Draw into a scratch figure first to learn which panels have data, then lay those out in a grid.
    scratch = plt.figure()
    present = [panel for panel in panels if panel[2](scratch.add_subplot())]
    plt.close(scratch)
    ncols = min(3, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.8 * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax, (title, ylabel, draw) in zip(flat, present):
        draw(ax)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in flat[len(present):]:
        fig.delaxes(ax)
    fig.suptitle(" vs ".join(run.label for run in runs))
    fig.tight_layout()
    return fig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help=f"a run's output directory (with {METRICS_FILE})")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png", help="the image to write")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="legend label per run (default: directory name)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.labels is not None and len(args.labels) != len(args.runs):
            raise MetricsError(f"--labels: {len(args.labels)} labels for {len(args.runs)} runs")
        runs = [load_run(run) for run in args.runs]
        fig = plot_runs(runs, args.labels)
        output = Path(args.output)
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(output, dpi=100)
        except (OSError, ValueError) as e:  # ValueError: an extension matplotlib cannot write
            raise MetricsError(f"{args.output}: cannot write ({e})") from None
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)
    except MetricsError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
