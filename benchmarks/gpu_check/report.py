"""The GPU check's table: one Row per check, printed as text and written as Markdown; a unit that produced no result
still gets its rows (error, timeout or skipped, with the reason)."""

from __future__ import annotations

from dataclasses import dataclass

BAD = ("error", "timeout", "FAIL")  # a row with one of these makes the exit status 1


@dataclass
class Row:
    """One line of the table; ``key`` (e.g. "c.mfu") names the check in gpu_check.json."""

    key: str
    check: str
    measured: str
    bar: str
    status: str
    note: str = ""


def failed_rows(state: dict, rows: list[tuple[str, str, str]]) -> list[Row]:
    """The unit's rows when it produced no result: error / timeout / skipped, with the reason."""
    if state.get("skipped_by_parent"):
        status, why = "skipped", state["skipped_by_parent"]
    elif state.get("timeout"):
        status, why = "timeout", state.get("error", "")
    else:
        status, why = "error", state.get("error") or "no result (see the log)"
    if state.get("log"):
        why += f" [log: {state['log']}]"
    return [Row(key, check, "-", bar, status, why) for key, check, bar in rows]


def cut_short(state: dict) -> str:
    """Why a unit stopped short, for a row that still has partial data; '' when it finished."""
    if state.get("timeout"):
        return "timeout"
    if state.get("error"):
        return "error"
    return ""


def unit_rows(unit: str, rows_of, state: dict, a) -> list[Row]:
    """``rows_of(state, a)``: the unit's rows built from what it measured."""
    try:
        return rows_of(state, a)
    except Exception as e:  # noqa: BLE001 - a bug in a row builder is a row, not a lost table
        return [Row(f"{unit}.report", f"({unit[0]}) report", "-", "-", "error", f"building the rows: {e!r}")]


def render_text(rows: list[Row], header: list[str]) -> str:
    names = ("check", "measured", "bar / expected", "status")
    cells = [(r.check, r.measured, r.bar, r.status) for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = header + [""]
    lines.append("  ".join(f"{n:{w}}" for n, w in zip(names, widths)) + "  note")
    lines.append("  ".join("-" * w for w in widths) + "  ----")
    for r, c in zip(rows, cells):
        lines.append("  ".join(f"{x:{w}}" for x, w in zip(c, widths)) + "  " + r.note)
    return "\n".join(lines)


def render_markdown(rows: list[Row], header: list[str]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["# GPU check", ""] + [f"- {h}" for h in header] + [""]
    lines.append("| check | measured | bar / expected | status | note |")
    lines.append("|---|---|---|---|---|")
    for r in rows:
        lines.append(f"| {esc(r.check)} | {esc(r.measured)} | {esc(r.bar)} | {esc(r.status)} | {esc(r.note)} |")
    return "\n".join(lines) + "\n"
