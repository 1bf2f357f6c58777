"""``kvfabric bench``: run the benchmarks, keep their JSON, plot them, summarize the targets.

Each benchmark (``benchmarks/NAME.py``, run by this interpreter with ``--json``, and
``--quick`` when asked and the script has it) writes into the output directory
``NAME.json`` (its JSON object), ``NAME.log`` (its stderr: its table, notes, missed
targets) and ``NAME.png`` (each target's headroom); then ``summary.json`` and
``summary.txt`` (the table printed at the end). The benchmarks ship with the source tree,
not with the wheel: they are found in ``--benchmarks-dir``, else ``./benchmarks``, else next
to the installed package (a checkout installed with ``pip install -e``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from kvfabric.commands.common import EXIT_USAGE, add_command, fail

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at start-up
if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from kvfabric.commands.bench_report import Result

EXIT_MISSED = 1  # a benchmark missed a target (as the benchmarks themselves exit)
EXIT_FAILED = 3  # a benchmark failed: a crash, a timeout, no JSON object
TERM_GRACE_S = 15.0  # after SIGTERM (the benchmarks then stop what they started)
# what tests/run.sh sets: no library phones home from a benchmark either
QUIET_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}

DESCRIPTION = """\
Run the benchmarks (benchmarks/*.py) one after the other with progress bars, write each one's
JSON object, stderr log and a PNG of its targets' headroom into --out, and print a summary of
every target: value, bound, met or missed. Exits 0 when every target was met, 1 when one was
missed, 3 when a benchmark failed (crashed, timed out, printed no JSON object), 2 on bad
flags. The PNGs need matplotlib (pip install 'kvfabric[plan]').

examples:
  kvfabric bench --list
  kvfabric bench --only store_bench --quick
  kvfabric bench --only store --only daemon --quick --out results/today
  kvfabric bench --skip soak --timeout 1800"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands,
        "bench",
        help="run the benchmarks: JSON, plots and a summary of their targets",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run this benchmark (store, store_bench or store_bench.py; repeatable); "
        "default: all of them",
    )
    parser.add_argument(
        "--skip", action="append", default=[], metavar="NAME", help="leave it out (repeatable)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="each benchmark's --quick: fewer rounds, smaller runs"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the results go (default: ./bench-results/<UTC time>)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop a benchmark that runs longer (SIGTERM, then SIGKILL): it counts as failed",
    )
    parser.add_argument(
        "--benchmarks-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the benchmark scripts are (default: ./benchmarks, else the checkout's)",
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks found and exit")
    parser.set_defaults(handler=run)


def benchmarks_dir(given: Path | None) -> Path | None:
    if given is not None:
        return given if given.is_dir() else None
    import kvfabric

    for candidate in (
        Path.cwd() / "benchmarks",
        Path(kvfabric.__file__).resolve().parents[1] / "benchmarks",
    ):
        if (candidate / "_runner.py").is_file():
            return candidate
    return None


def discover(directory: Path) -> dict[str, Path]:
    """Benchmark name -> script: every ``*.py`` not starting with ``_`` (the helpers)."""
    return {p.stem: p for p in sorted(directory.glob("*.py")) if not p.name.startswith("_")}


def resolve(names: list[str], found: dict[str, Path]) -> tuple[list[str], list[str]]:
    """``names`` as benchmark names (``store`` = ``store_bench`` = ``store_bench.py``, when
    that is unambiguous), and those that match none."""
    out, unknown = [], []
    for raw in names:
        name = raw.removesuffix(".py")
        matches = [n for n in found if n in (name, f"{name}_bench")] or [
            n for n in found if n.startswith(name)
        ]
        if len(matches) == 1:
            out.append(matches[0])
        else:
            unknown.append(raw)
    return out, unknown


def supports(script: Path, flag: str) -> bool:
    """Whether a script takes ``flag``: every script run through benchmarks/_runner.py does."""
    text = script.read_text(errors="replace")
    return flag in text or "run_benchmark(" in text


def run(args: argparse.Namespace) -> int:
    directory = benchmarks_dir(args.benchmarks_dir)
    if directory is None:
        return fail(
            "bench",
            "no benchmarks directory: the benchmarks ship with the source tree, not the wheel; "
            "run from a checkout or pass --benchmarks-dir",
            EXIT_USAGE,
        )
    found = discover(directory)
    if args.list:
        print("\n".join(found))
        return 0
    chosen, unknown = resolve(args.only, found)
    skipped, unknown_skips = resolve(args.skip, found)
    if unknown or unknown_skips:
        return fail(
            "bench",
            f"no benchmark (or more than one) matches {', '.join(unknown + unknown_skips)} "
            f"in {directory} (there: {', '.join(found)})",
            EXIT_USAGE,
        )
    names = [n for n in (list(dict.fromkeys(chosen)) or list(found)) if n not in skipped]
    if not names:
        return fail("bench", "no benchmark left to run", EXIT_USAGE)
    out = args.out or Path("bench-results") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    print(f"kvfabric bench: {', '.join(names)} from {directory} into {out}", file=sys.stderr)
    import signal

    # SIGTERM / SIGHUP unwind like Ctrl-C: the running benchmark is stopped, not orphaned
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _exit_on_signal)
    return _run_all(args, directory, names, found, out)


def _exit_on_signal(number: int, _frame: object) -> None:
    raise SystemExit(128 + number)


def _run_all(
    args: argparse.Namespace, directory: Path, names: list[str], found: dict[str, Path], out: Path
) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from kvfabric.commands.bench_report import FAILED, MISSED, plot, summary_table, write_summary

    console = Console(stderr=True)
    results: list[Result] = []
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", style="bold"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}", style="dim"),
        console=console,
        transient=False,
    ) as progress:
        overall = progress.add_task("benchmarks", total=len(names), last="")
        for name in names:
            current = progress.add_task(name, total=None, last="starting")
            result = _run_one(args, directory, name, found[name], out, progress, current)
            if result.figures is not None:
                try:
                    result.png = plot(result, out / f"{name}.png")
                except ImportError:
                    progress.update(current, last="no plot: matplotlib is not installed")
            progress.update(current, total=1, completed=1, last=result.status)
            progress.advance(overall)
            results.append(result)
    write_summary(out, results, quick=args.quick)
    Console(width=max(Console().width, 100)).print(summary_table(results, quick=args.quick))
    for result in results:
        if result.status == FAILED:
            print(
                f"kvfabric bench: {result.name} failed: {result.reason} (log: {result.log})",
                file=sys.stderr,
            )
    print(f"results: {out}", file=sys.stderr)
    statuses = {r.status for r in results}
    return EXIT_FAILED if FAILED in statuses else EXIT_MISSED if MISSED in statuses else 0


def _run_one(
    args: argparse.Namespace,
    directory: Path,
    name: str,
    script: Path,
    out: Path,
    progress: Progress,
    task: TaskID,
) -> Result:
    """Run one benchmark: stdout kept (its JSON), stderr into NAME.log line by line (the last
    line shown beside its progress bar)."""
    import subprocess
    import threading

    from kvfabric.commands.bench_report import Result, parse_output, target_rows

    argv = [sys.executable, str(script)]
    argv += ["--json"] if supports(script, "--json") else []
    argv += ["--quick"] if args.quick and supports(script, "--quick") else []
    env = {**QUIET_ENV, **os.environ}
    log_path = out / f"{name}.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            argv,
            cwd=directory.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )

        def copy_stderr() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                log.write(line)
                log.flush()
                if line.strip():
                    progress.update(task, last=line.strip()[:70])

        stderr_thread = threading.Thread(target=copy_stderr, daemon=True)
        stderr_thread.start()
        stopped = threading.Event()

        def stop() -> None:  # --timeout: the benchmark stops what it started on SIGTERM
            stopped.set()
            proc.terminate()
            try:
                proc.wait(TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()

        timer = threading.Timer(args.timeout, stop) if args.timeout else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            assert proc.stdout is not None
            stdout = proc.stdout.read()
            code = proc.wait()
        except BaseException:  # Ctrl-C: the benchmark got SIGINT too; wait for its cleanup
            stop()
            raise
        finally:
            if timer is not None:
                timer.cancel()
            stderr_thread.join(5.0)
    seconds = time.monotonic() - started
    figures = parse_output(stdout)
    result = Result(name, None if stopped.is_set() else code, seconds, figures, log_path)
    if figures is not None:
        import json

        result.json_path = out / f"{name}.json"
        result.json_path.write_text(json.dumps(figures, indent=2) + "\n")
        result.rows = target_rows(figures)
    if stopped.is_set():
        result.reason = f"timed out after {args.timeout:g} s"
    elif figures is None:
        result.reason = f"exit {code}, no JSON object on stdout"
    elif code not in (0, 1):
        result.reason = f"exit {code}"
    return result
