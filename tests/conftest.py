"""Shared test setup: telemetry off for every library, real daemons as subprocesses, and
real redis-servers on random loopback ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from redis_servers import RedisServer

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ (real engines, whole-daemon walks) is marked ``e2e``, so
    ``bash tests/run.sh -m "not e2e"`` runs the fast part; CI runs everything."""
    for item in items:
        if item.path.resolve().is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)


for _var, _value in {
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_var, _value)


@dataclass
class DaemonProcess:
    """A `kvfabric serve` child process on loopback / a socket under a temp dir."""

    data_dir: Path
    settings: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)

    @property
    def socket(self) -> str:
        return self.info["socket"]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}"

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        ready = self.data_dir / "ready.json"
        ready.unlink(missing_ok=True)
        args = [
            sys.executable,
            "-m",
            "kvfabric.cli",
            "serve",
            "--ready-file",
            str(ready),
            "--set",
            f"store.data_dir={self.data_dir}",
            "--set",
            "http.port=0",
            "--set",
            "http.host=127.0.0.1",
        ]
        for item in self.settings:
            args += ["--set", item]
        self.log = open(self.data_dir / "daemon.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.read_log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"daemon not ready in {timeout}s: {self.read_log()}")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        return self

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def read_log(self) -> str:
        return (self.data_dir / "daemon.log").read_text(errors="replace")[-4000:]


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
        daemon.log.close()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator:
    """Factory: start_daemon(*settings, data_dir=None) -> a running DaemonProcess."""
    started: list[DaemonProcess] = []

    def start(*settings: str, data_dir: Path | None = None) -> DaemonProcess:
        directory = data_dir or tmp_path / f"node{len(started)}"
        directory.mkdir(parents=True, exist_ok=True)
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
