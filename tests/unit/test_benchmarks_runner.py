"""benchmarks/_runner.py: a missed target is a non-zero exit status (and named), the JSON
object stays alone on stdout, and every benchmark's ``main`` is the runner's (its flags, the
scratch directory, the report). Each case runs in a child interpreter: importing the
benchmark modules caps thread pools process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=BENCHMARKS,
    )


REPORT = """
import sys
sys.path.insert(0, ".")
from _runner import report
figures = {{"ops_per_s": {ops}, "p99_us": {p99}}}
targets = {{"ops_per_s": (">=", 1000.0), "p99_us": ("<=", 50.0)}}
described = [("ops_per_s", "throughput"), ("p99_us", "tail latency")]
sys.exit(report(figures, targets, described, as_json={as_json}, quick=True))
"""


def test_report_exits_non_zero_and_names_each_missed_target() -> None:
    """Regression: on the old code report() returned None and every benchmark exited 0 with
    its targets missed."""
    done = _python(REPORT.format(ops=10.0, p99=70.0, as_json=False))
    assert done.returncode == 1
    missed = [line for line in done.stderr.splitlines() if "target missed" in line]
    assert len(missed) == 2
    assert "ops_per_s = 10.0 (target >= 1000.0)" in missed[0]
    assert "p99_us = 70.0 (target <= 50.0)" in missed[1]
    assert "NO" in done.stdout  # the table still says which


def test_report_exits_0_when_every_target_is_met_and_json_stays_clean() -> None:
    done = _python(REPORT.format(ops=2000.0, p99=10.0, as_json=True))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["all_targets_met"] is True
    assert "target missed" not in done.stderr


def test_a_figure_that_was_not_measured_misses_its_target() -> None:
    done = _python(REPORT.format(ops=None, p99=10.0, as_json=True))
    assert done.returncode == 1
    assert json.loads(done.stdout)["targets_met"]["ops_per_s"] is False
    assert "ops_per_s = None" in done.stderr


RUNNER = """
import sys
sys.path.insert(0, ".")
from _runner import Benchmark, Outcome, run_benchmark
BENCH = Benchmark(
    "A fake benchmark.\\n\\nmore",
    "kvfabric-fake-bench-",
    {{"ops_per_s": (">=", 1000.0)}},
    [("ops_per_s", "throughput"), ("p99_us", "tail latency")],
    keep_option=True,
)
def measure(args, root):
    (root / "scratch-file").write_text("x")
    print(root, file=sys.stderr)
    return Outcome({{"ops_per_s": {ops}, "extra": [1, 2]}}, notes=["a note"])
sys.exit(run_benchmark(BENCH, measure, {argv}))
"""


def test_run_benchmark_reports_and_exits_with_the_targets_verdict() -> None:
    done = _python(RUNNER.format(ops=2000.0, argv=["--json", "--quick"]))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["ops_per_s"] == 2000.0 and out["extra"] == [1, 2] and out["quick"] is True
    assert out["targets_met"] == {"ops_per_s": True}
    assert "p99_us" not in done.stderr  # a row whose figure was not measured is left out
    assert "note: a note" in done.stderr
    scratch = Path(done.stderr.splitlines()[0])
    assert not scratch.exists()  # the scratch directory is removed


def test_run_benchmark_keeps_the_scratch_of_a_missed_target_where_asked() -> None:
    done = _python(RUNNER.format(ops=10.0, argv=[]))
    assert done.returncode == 1
    assert "ops_per_s = 10.0 (target >= 1000.0)" in done.stderr
    scratch = Path(done.stderr.splitlines()[0])
    try:
        assert f"work directory kept: {scratch}" in done.stderr
        assert (scratch / "scratch-file").exists()
    finally:
        (scratch / "scratch-file").unlink(missing_ok=True)
        scratch.rmdir()


def test_every_benchmark_main_is_the_runner() -> None:
    """Regression: each script had its own main() (arguments, scratch directory, report);
    one that ignored report()'s status exited 0 with its targets missed."""
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py")) if not p.name.startswith("_")]
    assert len(scripts) >= 7
    for path in scripts:
        text = path.read_text()
        assert "return run_benchmark(BENCH, " in text, f"{path.name} has a main of its own"
        assert "argparse.ArgumentParser(" not in text, f"{path.name} parses on its own"
        assert "report(" not in text, f"{path.name} reports on its own"
