"""Fixtures for tests that run a real vLLM (CPU build) on a tiny random-weight Llama.

`tiny_model` (tests/e2e/conftest.py): the model directory.
`run_engines`: job dict -> result dict, running tests/e2e/vllm/engine_runner.py in a subprocess
(see its docstring for the job and result schema). `model` and `scratch_dir` default to the
tiny model and a per-test temp dir. `model_job_runner`: the same for a model the test builds
itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_jobs import run_engine_job

HERE = Path(__file__).resolve().parent
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
    """Run one engine_runner job in ``workdir``; fails the test if the child fails.
    ``timeout``: the stall allowed (default: derived from the session's slowest step)."""
    job = {"model": str(model), "scratch_dir": str(workdir / "scratch"), **job}
    run = run_engine_job(workdir, job, stall_s=timeout or stall_limit_s())
    if run.code is not None:
        _slowest_step_s.append(run.slowest_step_s)
    failure = run.failure()
    if failure is not None:
        pytest.fail(failure)
    assert run.result is not None
    result = EngineResult(run.result)
    result["wall_s"] = run.wall_s
    return result


@pytest.fixture(scope="session")
def model_job_runner() -> Callable[..., EngineResult]:
    """model_job_runner(model, workdir, job, timeout=None) -> result, for jobs on a model of
    the test's own (e.g. test_vllm_mla.py's tiny DeepSeek); same stall limits as job_runner."""
    return run_job


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
