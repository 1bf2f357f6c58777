"""``kvfabric bench``'s results: each benchmark's verdict, the summary table, the plots.

A benchmark's JSON object (``benchmarks/_runner.py``) holds its figures by name plus
``targets`` (``{figure: [op, bound]}``), ``targets_met`` (``{figure: bool}``) and
``all_targets_met``. Its exit status says the rest: 0 every target met, 1 one missed, anything
else (or no JSON object on stdout) a benchmark that failed to measure.

Imported by :func:`kvfabric.commands.bench.run` only: it loads rich, and matplotlib for plots.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

EXIT_MISSED = 1  # benchmarks/_runner.py's exit status for a missed target

MET, MISSED, FAILED = "met", "missed", "failed"


@dataclass(frozen=True)
class TargetRow:
    figure: str
    value: Any  # what the JSON holds: a number, or None when it was not measured
    op: str | None  # ">=" / "<="; None: an older benchmark JSON without ``targets``
    bound: float | None
    met: bool

    @property
    def target(self) -> str:
        return "" if self.op is None else f"{self.op} {_number(self.bound)}"


@dataclass
class Result:
    """One benchmark's run: its status (met, missed, failed) and where its files are."""

    name: str
    exit_code: int | None  # None: it was stopped (timeout)
    seconds: float
    figures: dict[str, Any] | None  # its JSON object; None when it printed none
    log: Path
    json_path: Path | None = None
    png: Path | None = None
    reason: str = ""  # why it failed
    rows: list[TargetRow] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.figures is None or self.exit_code not in (0, EXIT_MISSED):
            return FAILED
        return MET if self.exit_code == 0 and all(r.met for r in self.rows) else MISSED

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "reason": self.reason or None,
            "json": None if self.json_path is None else str(self.json_path),
            "png": None if self.png is None else str(self.png),
            "log": str(self.log),
            "targets": [
                {"figure": r.figure, "value": r.value, "op": r.op, "bound": r.bound, "met": r.met}
                for r in self.rows
            ],
        }


def parse_output(stdout: str) -> dict[str, Any] | None:
    """The benchmark's JSON object: all of stdout, else the last object that starts a line
    (a library may have printed before it); None when there is none."""
    text = stdout.strip()
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and text[i + 1 : i + 2] == "{"]
    for start in starts:
        try:
            value = json.loads(text[start:])
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


def target_rows(figures: Mapping[str, Any]) -> list[TargetRow]:
    """One row per target the benchmark held itself to, in its order."""
    verdicts = figures.get("targets_met")
    bounds = figures.get("targets")
    if not isinstance(verdicts, Mapping):
        return []
    rows = []
    for name, met in verdicts.items():
        bound = bounds.get(name) if isinstance(bounds, Mapping) else None
        op, limit = None, None
        if isinstance(bound, list) and len(bound) == 2:
            op, limit = str(bound[0]), float(bound[1])
        rows.append(TargetRow(str(name), figures.get(name), op, limit, bool(met)))
    return rows


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


def summary_table(results: Sequence[Result], *, quick: bool) -> Table:
    """The one-screen summary: per benchmark, each target's value, bound and verdict."""
    table = Table(
        title=f"kvfabric bench{' --quick' if quick else ''}: {_counts(results)}",
        title_justify="left",
        show_lines=False,
    )
    table.add_column("benchmark", no_wrap=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right", no_wrap=True)
    table.add_column("met", no_wrap=True)
    for result in results:
        head = f"{result.name} ({result.seconds:.0f} s)"
        if result.status == FAILED:
            table.add_row(head, result.reason, "", "", Text("FAILED", style="bold red"))
        elif not result.rows:
            table.add_row(head, "(no targets)", "", "", "")
        for i, row in enumerate(result.rows):
            verdict = Text("yes", style="green") if row.met else Text("MISSED", style="bold red")
            table.add_row(
                head if i == 0 else "", row.figure, _number(row.value), row.target, verdict
            )
        table.add_section()
    return table


_WORDS = ((MET, "met every target"), (MISSED, "missed a target"), (FAILED, "failed"))


def _counts(results: Iterable[Result]) -> str:
    statuses = [r.status for r in results]
    counts = [(statuses.count(status), word) for status, word in _WORDS]
    return ", ".join(f"{n} {word}" for n, word in counts if n) or "nothing ran"


def write_summary(out_dir: Path, results: Sequence[Result], *, quick: bool) -> tuple[Path, Path]:
    """``summary.json`` (every result) and ``summary.txt`` (the table as plain text)."""
    data = {
        "quick": quick,
        "all_targets_met": bool(results) and all(r.status == MET for r in results),
        "failed": [r.name for r in results if r.status == FAILED],
        "missed": [r.name for r in results if r.status == MISSED],
        "benchmarks": [r.as_dict() for r in results],
    }
    json_path = out_dir / "summary.json"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    text_path = out_dir / "summary.txt"
    with text_path.open("w") as file:
        Console(file=file, width=120, no_color=True, emoji=False).print(
            summary_table(results, quick=quick)
        )
    return json_path, text_path


# -- plots -------------------------------------------------------------------------------

CLIP = 3.0  # headroom past 3x the target is drawn as 3x (the label says the real value)


def headroom(row: TargetRow) -> float | None:
    """How far a figure is on the good side of its bound: 1 at the bound, above 1 met (value
    over bound for ``>=``, bound over value for ``<=``); None when there is no number."""
    value = row.value
    if row.op is None or row.bound is None or isinstance(value, bool):
        return None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if row.bound == 0:  # e.g. corrupt_reads <= 0: no ratio, only the verdict
        return CLIP if row.met else 0.0
    ratio = value / row.bound if row.op == ">=" else (row.bound / value if value else math.inf)
    return max(0.0, ratio)


def plot(result: Result, path: Path) -> Path | None:
    """A bar per target: its headroom (1 = the target), green met, red missed. None when the
    benchmark has no target with a number."""
    rows = [(row, headroom(row)) for row in result.rows]
    drawn = [(row, h) for row, h in rows if h is not None]
    if not drawn:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    height = 1.2 + 0.45 * len(drawn)
    figure, axes = plt.subplots(figsize=(9, height))
    try:
        names = [row.figure for row, _ in drawn]
        widths = [min(h, CLIP) for _, h in drawn]
        colors = ["#2e7d32" if row.met else "#c62828" for row, _ in drawn]
        axes.barh(names, widths, color=colors)
        axes.axvline(1.0, color="black", linewidth=1, linestyle="--")
        for y, (row, h) in enumerate(drawn):
            label = f"{_number(row.value)} ({row.target})"
            axes.text(
                min(h, CLIP) + 0.03,
                y,
                label,
                va="center",
                fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
            )
        axes.set_xlim(0, CLIP * 1.45)
        axes.invert_yaxis()  # the benchmark's order, top down
        axes.set_xlabel("headroom: value against its target (1 = the target; right of it: met)")
        quick = " (--quick)" if result.figures and result.figures.get("quick") else ""
        axes.set_title(f"{result.name}{quick}: {result.status}")
        figure.tight_layout()
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)
    return path
