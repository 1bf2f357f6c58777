"""``tests/run.sh``'s pytest options (the README's and CI's test command) on a small suite
in which one test takes its worker down: the run ends, failed, naming the test; it does not
wait forever for the crashed worker's work (pytest-xdist 3.8.0 can, with ``--dist loadfile``
and replaced workers: issues #784 and #1378 there)."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

RUN_SH = Path(__file__).resolve().parents[1] / "run.sh"


def pytest_options() -> list[str]:
    """The options run.sh passes pytest, its worker count set to 2 and "$@" left out."""
    text = RUN_SH.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("exec ") and "-m pytest" in ln]
    words = shlex.split(line.replace('"$workers"', "2").replace('"$@"', ""))
    return words[words.index("pytest") + 1 :]


def test_a_crashed_worker_fails_the_run_instead_of_hanging_it(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_crash.py").write_text(
        "import os\n\ndef test_before():\n    pass\n\n"
        "def test_crash():\n    os.abort()\n\ndef test_after():\n    pass\n"
    )
    for name in "bcde":  # more files than workers: the crashed worker still has work queued
        (suite / f"test_{name}.py").write_text(
            "import time\n\n"
            + "".join(f"def test_{name}{i}():\n    time.sleep(0.3)\n\n" for i in range(3))
        )
    options = pytest_options()
    assert "--dist" in options and "--max-worker-restart=0" in options
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *options, str(suite)],
        capture_output=True,
        text=True,
        timeout=300,  # a hang is the failure: it would not end at all
        cwd=tmp_path,
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout[-2000:]
    assert "crashed while running" in done.stdout and "test_crash" in done.stdout
    assert took < 240, f"took {took:.0f} s"
