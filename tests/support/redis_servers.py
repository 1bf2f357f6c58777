"""Real ``redis-server`` children for tests: one server on a random loopback port, or a
3-master Redis Cluster. The fixtures that use them are in the tests' conftest files."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis


class RedisServer:
    """One redis-server child without persistence; restart() comes back empty, same port."""

    def __init__(self, workdir: Path, extra_args: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not on PATH: install it (e.g. apt-get install "
                "redis-server) to run the global index tests"
            )
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
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


class RedisClusterServers:
    """Three cluster-enabled redis-server children (masters, no replicas) made one Redis
    Cluster with ``redis-cli --cluster create``; :attr:`url` is the index's cluster URL."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            pytest.fail("redis-cli is not on PATH: it creates the Redis Cluster of the tests")
        self.servers: list[RedisServer] = []
        for _ in range(masters):
            server = RedisServer(workdir)
            server.port = free_cluster_port()
            server.extra_args = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{server.port}.conf",
                "--cluster-node-timeout",
                "5000",
            )
            self.servers.append(server)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}/0"

    def start(self) -> RedisClusterServers:
        try:
            for server in self.servers:
                server.start()
            subprocess.run(
                [
                    str(self.cli),
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{s.port}" for s in self.servers),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=30,
            )
            self._wait_ok()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + 20
        clients = [redis.Redis(port=s.port, socket_timeout=0.5) for s in self.servers]
        try:
            while True:
                infos = [client.cluster("INFO") for client in clients]
                if all(info.get("cluster_state") == "ok" for info in infos):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Redis Cluster did not reach cluster_state:ok: {infos}")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def kill(self) -> None:
        for server in self.servers:
            server.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_cluster_port() -> int:
    """A free port P whose cluster bus port P + 10000 is a valid port and free too."""
    for _ in range(1000):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")
