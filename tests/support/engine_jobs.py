"""Engine jobs for the vLLM tests and benchmarks: ``tests/e2e/vllm/engine_runner.py`` run on
a job file in a child process, and the pieces of a job both sides build alike.

:func:`run_engine_job` writes ``workdir/job.json``, starts the runner as a
:class:`child_process.Child` (a process group of its own, so vLLM's engine core and worker
processes go with it; it dies with its parent), and waits while the job moves: it is killed
once no progress line (the runner writes one per vLLM import, engine build and prompt to
``result.progress``) came for ``stall_s`` seconds, or when it has run ``deadline_s`` seconds
in all. Whatever the job left in its group is killed when it ends. What it found is a
:class:`JobRun`; :meth:`JobRun.failure` says why it failed, for the caller to raise (a
benchmark) or fail the test with (the e2e fixtures).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from child_process import Child

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = REPO_ROOT / "tests" / "e2e" / "vllm" / "engine_runner.py"
BUILDER = REPO_ROOT / "tests" / "models" / "build_tiny_llama.py"


def load_model_builder() -> ModuleType:
    """tests/models/build_tiny_llama.py as a module (its ``build_tiny_llama(dir, ...)``
    builds a random-weight Llama there, or does nothing when it is already built)."""
    spec = importlib.util.spec_from_file_location("kvfabric_build_tiny_llama", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kvfabric_connector(socket: str, role: str = "kv_both", **extra: object) -> dict[str, Any]:
    """A job's ``kv_transfer_config`` for KVFabricConnector on the daemon at ``socket``;
    ``extra`` goes into its ``kv_connector_extra_config``."""
    return {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": "kvfabric_connectors.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_path": socket, **extra},
    }


@dataclass(frozen=True)
class JobRun:
    """How one engine job ended."""

    code: int | None  # the runner's exit code; None: killed, stalled or past its deadline
    killed_after_s: float  # the limit it was killed at (when code is None)
    result: dict[str, Any] | None  # the runner's result.json; None when it wrote none
    log_tail: str
    wall_s: float
    slowest_step_s: float  # the longest gap between its start and progress lines

    def failure(self) -> str | None:
        """Why the job failed (the log's tail included), or None when it succeeded."""
        if self.code is None:
            return (
                f"engine_runner killed: no progress or no end within "
                f"{self.killed_after_s:.0f}s; log tail:\n{self.log_tail}"
            )
        if self.result is None:
            return f"engine_runner exited {self.code} without a result; log tail:\n{self.log_tail}"
        if self.code != 0 or not self.result.get("ok"):
            return (
                f"engine_runner failed (rc={self.code}): {self.result.get('error')}\n"
                f"{self.result.get('traceback', '')}\nlog tail:\n{self.log_tail}"
            )
        return None


def run_engine_job(
    workdir: Path, job: dict[str, Any], *, stall_s: float, deadline_s: float | None = None
) -> JobRun:
    """Run ``job`` (engine_runner's schema) in ``workdir`` and wait for it (see above)."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, result_file, log_file = (
        workdir / "job.json",
        workdir / "result.json",
        workdir / "log",
    )
    progress_file = result_file.with_suffix(".progress")
    for stale in (result_file, progress_file, log_file):
        stale.unlink(missing_ok=True)
    job_file.write_text(json.dumps(job, indent=1))
    started = time.monotonic()
    argv = [sys.executable, str(RUNNER), str(job_file), str(result_file)]
    child = Child("engine_runner", argv, log_file, cwd=REPO_ROOT).start()
    try:
        moved = _wait_while_moving(child, progress_file, stall_s, deadline_s)
    finally:
        code = child.kill()  # the job's vLLM children must not outlive it either
    wall_s = time.monotonic() - started
    try:
        tail = log_file.read_text(errors="replace")[-6000:]
    except OSError:
        tail = "<no log>"
    return JobRun(
        code=code if moved else None,
        killed_after_s=stall_s if deadline_s is None else min(stall_s, deadline_s),
        result=json.loads(result_file.read_text()) if result_file.exists() else None,
        log_tail=tail,
        wall_s=wall_s,
        slowest_step_s=_slowest_step(progress_file, started),
    )


def _wait_while_moving(
    child: Child, progress_file: Path, stall_s: float, deadline_s: float | None
) -> bool:
    """Whether the job ended before it went ``stall_s`` seconds without a progress line
    (or ran ``deadline_s`` seconds in all). It is left unreaped: its group is still there."""
    started = last = time.monotonic()
    size = 0
    while not child.exited(1.0):
        now = time.monotonic()
        now_size = progress_file.stat().st_size if progress_file.exists() else 0
        if now_size != size:
            size, last = now_size, now
        elif now - last > stall_s:
            return False
        if deadline_s is not None and now - started > deadline_s:
            return False
    return True


def _slowest_step(progress_file: Path, started_monotonic: float) -> float:
    """The longest gap between the job's start and its progress lines, or between two."""
    try:
        times = [json.loads(line)["t"] for line in progress_file.read_text().splitlines()]
    except (OSError, ValueError, KeyError):
        return 0.0
    start = time.time() - (time.monotonic() - started_monotonic)
    points = [start, *times]
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)
