"""benchmarks/_common.py: a missed target is a non-zero exit status (and named), and a
benchmark that is stopped leaves no child process behind. Each case runs in a child
interpreter: importing _common caps thread pools and installs handlers process-wide."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _python(code: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=BENCHMARKS,
        **kwargs,
    )


REPORT = """
import sys
sys.path.insert(0, ".")
from _common import report
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


SPAWNER = """
import subprocess, sys, time
sys.path.insert(0, ".")
import _common
_common.install_cleanup()
# one child in a session of its own with a grandchild (as engine runners start vLLM), one plain
group = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600"], start_new_session=True)
plain = subprocess.Popen(["sleep", "600"])
time.sleep(0.5)
try:  # the pids are printed inside: the SIGTERM that follows them lands in here
    print(" ".join(map(str, _common.descendants())), flush=True)
    time.sleep(600)
finally:
    print("finally ran", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_leaves_no_child_process_behind() -> None:
    """Regression: on the old code a SIGTERM killed the benchmark without running its
    finally blocks, and its engine process (a session of its own) was orphaned."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SPAWNER],
        cwd=BENCHMARKS,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) >= 4  # sh, its two sleeps, the plain sleep
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "finally ran" in out
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if _alive(pid)] == []


def test_every_benchmark_returns_reports_status() -> None:
    """Each benchmark's main returns report()'s status (soak.py computes its own)."""
    for path in sorted(BENCHMARKS.glob("*.py")):
        text = path.read_text()
        if path.name in ("_common.py", "soak.py") or "report(" not in text:
            continue
        assert "return report(" in text, f"{path.name} ignores report()'s exit status"
    assert os.path.exists(BENCHMARKS / "_common.py")


def test_run_as_a_script_installs_the_cleanup() -> None:
    """A script of benchmarks/ gets the handlers at import; pytest or `python -c` do not."""
    code = "import sys; sys.path.insert(0, '.'); import _common; print(_common._cleanup_installed)"
    as_script = _python(f"import sys; sys.argv = ['store_bench.py']; {code}")
    assert as_script.stdout.strip() == "True", as_script.stderr
    outside = _python(code)
    assert outside.stdout.strip() == "False", outside.stderr
