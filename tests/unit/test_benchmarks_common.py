"""benchmarks/_common.py: a benchmark that is stopped leaves no child process behind, and
the process helpers it shares with the tests are importable. Each case runs in a child
interpreter: importing _common caps thread pools and installs handlers process-wide."""

from __future__ import annotations

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


def test_run_as_a_script_installs_the_cleanup() -> None:
    """A script of benchmarks/ gets the handlers at import; pytest or `python -c` do not."""
    code = "import sys; sys.path.insert(0, '.'); import _common; print(_common._cleanup_installed)"
    as_script = _python(f"import sys; sys.argv = ['store_bench.py']; {code}")
    assert as_script.stdout.strip() == "True", as_script.stderr
    outside = _python(code)
    assert outside.stdout.strip() == "False", outside.stderr


def test_the_process_helpers_shared_with_the_tests_import_from_a_benchmark() -> None:
    """benchmarks/ start daemons and redis-servers with tests/support's helpers."""
    code = (
        "import sys; sys.path.insert(0, '.'); import _common; "
        "from daemon_process import DaemonProcess; from redis_process import RedisServer; "
        "from engine_jobs import run_engine_job; print('ok')"
    )
    done = _python(code)
    assert done.stdout.strip() == "ok", done.stderr


def test_figures_name_the_host_cpu_and_whether_it_has_amx() -> None:
    flags = next(
        (
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        "",
    )
    done = _python("import sys; sys.path.insert(0, '.'); import _common; print(_common.host_cpu())")
    described = done.stdout.strip()
    assert described.endswith("(AMX: yes)" if "amx_tile" in flags.split() else "(AMX: no)")
    assert described and not described.startswith("unknown"), done.stderr
