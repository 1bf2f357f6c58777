"""A real ``redis-server`` on a random loopback port, and the two global index backends.

The integration suite loads this file too (test dirs are not packages under importlib mode).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvfabric.cluster import EmbeddedIndex, EmbeddedState, GlobalIndex
from kvfabric.cluster.redis_index import RedisGlobalIndex


class RedisServer:
    """One redis-server child without persistence; restart() comes back empty, same port."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH: install it (e.g. apt-get install "
                        "redis-server) to run the global index tests")
        self.binary, self.workdir = binary, workdir
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)
            finally:
                client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


IndexFactory = Callable[..., GlobalIndex]


@pytest.fixture(params=["embedded", "redis"])
def make_index(request: pytest.FixtureRequest) -> Iterator[IndexFactory]:
    """make_index(lease_ttl=10.0, **options) -> a node's index on one shared backend.

    Every index a test makes sees the same state (one EmbeddedState / one Redis prefix), like
    several daemons sharing a cluster. The lease TTL is per backend state: the first call's
    value applies to embedded indexes.
    """
    made: list[GlobalIndex] = []
    state: list[EmbeddedState] = []
    prefix = f"t{uuid.uuid4().hex[:8]}"
    server = request.getfixturevalue("shared_redis") if request.param == "redis" else None

    def make(lease_ttl: float = 10.0, **options: object) -> GlobalIndex:
        index: GlobalIndex
        if server is None:
            if not state:
                state.append(EmbeddedState(lease_ttl=lease_ttl))
            index = EmbeddedIndex(state[0], **options)  # type: ignore[arg-type]
        else:
            index = RedisGlobalIndex(server.url, prefix=prefix, lease_ttl=lease_ttl,
                                     **options)  # type: ignore[arg-type]
        made.append(index)
        return index

    make.backend = request.param  # type: ignore[attr-defined]
    yield make
    for index in made:
        index.close()
