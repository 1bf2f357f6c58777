"""Shared test setup: telemetry off for every library, real daemons as subprocesses
(:mod:`daemon_process`), and real redis-servers on random loopback ports
(:mod:`redis_process`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from redis_process import RedisServer

TESTS_DIR = Path(__file__).resolve().parent
E2E_DIR = TESTS_DIR / "e2e"
# Under pytest-xdist (tests/run.sh runs two workers, one module per worker at a time) these
# go first: their engines take minutes, and left to the end one worker would run them alone.
HEAVY_DIRS = (E2E_DIR, TESTS_DIR / "chaos", TESTS_DIR / "integration" / "packaging")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ (real engines, whole-daemon walks) is marked ``e2e``, so
    ``bash tests/run.sh -m "not e2e"`` runs the fast part; CI runs everything."""
    for item in items:
        if item.path.resolve().is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
    if _XDIST_WORKER:
        items.sort(key=lambda i: not any(i.path.resolve().is_relative_to(d) for d in HEAVY_DIRS))


def _pin_engines_to_worker_core(worker: str) -> None:
    """vLLM's automatic binding puts every CPU engine's OpenMP team on the same core (the
    first one it does not reserve): two workers' engines would share it while the other core
    idles. Each worker's engines get a core of their own unless a test binds them itself."""
    cpus = sorted(os.sched_getaffinity(0))
    index = int(worker.removeprefix("gw") or 0)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cpus[index % len(cpus)]))


_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER:
    _pin_engines_to_worker_core(_XDIST_WORKER)


for _var, _value in {
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_var, _value)


@pytest.fixture(scope="module")
def start_module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Factory for daemons shared by every test of a module: start(name, *settings)."""
    started: list[DaemonProcess] = []

    def start(name: str, *settings: str) -> DaemonProcess:
        daemon = DaemonProcess(tmp_path_factory.mktemp(name), list(settings)).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator:
    """Factory: start_daemon(*settings, data_dir=None) -> a running DaemonProcess."""
    started: list[DaemonProcess] = []

    def start(*settings: str, data_dir: Path | None = None) -> DaemonProcess:
        directory = data_dir or tmp_path / f"node{len(started)}"
        daemon = DaemonProcess(directory, list(settings)).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for a module; tests isolate themselves with a key prefix."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()
