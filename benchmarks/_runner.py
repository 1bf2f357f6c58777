"""The benchmark runner: every ``benchmarks/*.py`` script's ``main`` is one call of
:func:`run_benchmark` with its :class:`Benchmark` and the function that measures.

What the runner does for each script:

* arguments: ``--quick`` and ``--json`` always, ``--dir`` (where the scratch directory is
  made) and ``--keep`` where the benchmark asks for them, and the script's own flags
  (``Benchmark.add_arguments``); ``--help``'s description is the docstring's first line;
* a scratch directory (``tempfile.mkdtemp``) handed to the measuring function and removed
  afterwards (``--keep``: kept, as it is after a failure or a missed target for benchmarks
  with ``keep_option``);
* torch limited to one thread when something imported it;
* the report (:func:`report`): an aligned table for people and, with ``--json``, exactly one
  JSON object on stdout (the table then goes to stderr), so the output can be piped into a
  JSON parser; the figures' names are the JSON keys, plus ``targets`` (each target's
  ``[op, bound]``), ``targets_met``, ``all_targets_met`` and ``quick``;
* the exit status: :data:`EXIT_MISSED` (1) when a target was missed, each one named on
  stderr (``store_bench.py: target missed: NAME = VALUE (target OP BOUND)``), else 0.

Child processes are not the runner's: a script's import of :mod:`_common` installs the
cleanup that leaves none behind, and the helpers that start them kill them when done.
"""

from __future__ import annotations

# isort: off
from _common import limit_torch_threads  # first: the thread caps come before numpy loads
# isort: on

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

Target = tuple[str, float]  # (">=" or "<=", bound)


@dataclass(frozen=True)
class Outcome:
    """What one measuring run found. ``figures``: the JSON object's keys (numbers, or
    anything JSON takes: those without a table row go into the JSON only); ``described``:
    the table's rows (default: the benchmark's rows whose figure was measured); ``targets``:
    what this run is held to (default: the benchmark's); ``notes``: lines for stderr after
    the table."""

    figures: dict[str, Any]
    described: Sequence[tuple[str, str]] | None = None
    targets: Mapping[str, Target] | None = None
    notes: Sequence[str] = ()


@dataclass(frozen=True)
class Benchmark:
    """One benchmark script's fixed parts."""

    doc: str  # the script's docstring; its first line describes it in --help
    scratch_prefix: str  # of the scratch directory's name
    targets: Mapping[str, Target]
    figures: Sequence[tuple[str, str]]  # table rows: (figure, what it is)
    quick_help: str = "fewer rounds: under a minute"
    scratch_dir_option: bool = False  # --dir: where the scratch directory is made
    keep_option: bool = False  # --keep; a failed run or a missed target keeps it too
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = field(default=None)


def model_dir_option(parser: argparse.ArgumentParser) -> None:
    """``--model-dir``: for the benchmarks that build a model (``Benchmark.add_arguments``)."""
    parser.add_argument(
        "--model-dir", type=Path, help="build (or reuse) the model here instead of in the temp dir"
    )


def parser_for(bench: Benchmark) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=bench.doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=bench.quick_help)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout; the table goes to stderr",
    )
    if bench.scratch_dir_option:
        parser.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="where to create the scratch directory (default: system temp)",
        )
    if bench.add_arguments is not None:
        bench.add_arguments(parser)
    if bench.keep_option:
        parser.add_argument("--keep", action="store_true", help="keep the work directory")
    return parser


def run_benchmark(
    bench: Benchmark,
    measure: Callable[[argparse.Namespace, Path], Outcome],
    argv: list[str] | None = None,
) -> int:
    """Parse ``argv``, run ``measure(args, scratch_dir)``, report; the exit status."""
    args = parser_for(bench).parse_args(argv)
    limit_torch_threads()
    scratch = Path(tempfile.mkdtemp(prefix=bench.scratch_prefix, dir=getattr(args, "dir", None)))
    keep = bench.keep_option and args.keep
    try:
        outcome = measure(args, scratch)
        described = outcome.described
        if described is None:
            described = [(name, what) for name, what in bench.figures if name in outcome.figures]
        targets = bench.targets if outcome.targets is None else outcome.targets
        status = report(outcome.figures, targets, described, as_json=args.json, quick=args.quick)
        for line in outcome.notes:
            print(f"note: {line}", file=sys.stderr)
        keep = keep or (bench.keep_option and status != 0)
    except BaseException:
        keep = keep or bench.keep_option
        raise
    finally:
        if keep:
            print(f"work directory kept: {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return status


def print_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str], file: TextIO = sys.stdout
) -> None:
    """An aligned text table; floats get 4 significant digits, numbers align right."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    cells = [[cell(row.get(column)) for column in columns] for row in rows]
    widths = [
        max([len(column), *(len(line[i]) for line in cells)]) for i, column in enumerate(columns)
    ]
    numeric = [
        all(isinstance(row.get(column), (int, float)) or row.get(column) is None for row in rows)
        for column in columns
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    print(line(columns), file=file)
    print(line(["-" * w for w in widths]), file=file)
    for values in cells:
        print(line(values), file=file)


def emit_json(obj: Mapping[str, Any]) -> None:
    """Print ``obj`` as one JSON document on stdout."""
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def met(value: float | None, op: str, target: float) -> bool:
    """Whether ``value`` meets ``op target``; a figure that could not be measured does not."""
    if value is None:
        return False
    return value >= target if op == ">=" else value <= target


EXIT_MISSED = 1  # a benchmark's exit status when a target was missed


def missed_targets(
    figures: Mapping[str, float | None], targets: Mapping[str, tuple[str, float]]
) -> list[str]:
    """One line per missed target: ``name = value (target op bound)``."""
    return [
        f"{name} = {figures.get(name)} (target {op} {bound})"
        for name, (op, bound) in targets.items()
        if not met(figures.get(name), op, bound)
    ]


def report(
    figures: Mapping[str, float],
    targets: Mapping[str, tuple[str, float]],
    described: Sequence[tuple[str, str]],
    *,
    as_json: bool,
    quick: bool,
) -> int:
    """The table (stderr when JSON goes to stdout) and, with ``as_json``, one JSON object.

    Returns the exit status: :data:`EXIT_MISSED` when a target was missed (each one named on
    stderr, after the table), else 0."""
    verdicts = {name: met(figures.get(name), *target) for name, target in targets.items()}
    rows = [
        {
            "figure": name,
            "value": figures[name],
            "target": " ".join(map(str, targets[name])) if name in targets else "",
            "met": ("yes" if verdicts[name] else "NO") if name in targets else "",
            "what": what,
        }
        for name, what in described
    ]
    print_table(
        rows,
        ["figure", "value", "target", "met", "what"],
        file=sys.stderr if as_json else sys.stdout,
    )
    if as_json:
        emit_json(
            {
                **figures,
                # the bounds too: a reader of the JSON alone (kvfabric bench) can show them
                "targets": {name: [op, bound] for name, (op, bound) in targets.items()},
                "targets_met": verdicts,
                "all_targets_met": all(verdicts.values()),
                "quick": quick,
            }
        )
    missed = missed_targets(figures, targets)
    for line in missed:
        print(f"{Path(sys.argv[0]).name}: target missed: {line}", file=sys.stderr)
    sys.stderr.flush()
    return EXIT_MISSED if missed else 0
