"""A 3-master Redis Cluster of real ``redis-server`` children for tests (one server alone:
:mod:`redis_process`). The fixtures that use them are in the tests' conftest files."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from child_process import free_port
from redis_process import RedisServer


class RedisClusterServers:
    """Three cluster-enabled redis-server children (masters, no replicas) made one Redis
    Cluster with ``redis-cli --cluster create``; :attr:`url` is the index's cluster URL."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            pytest.fail("redis-cli is not on PATH: it creates the Redis Cluster of the tests")
        self.servers: list[RedisServer] = []
        for _ in range(masters):
            port = free_cluster_port()
            cluster_args = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "5000",
            )
            self.servers.append(RedisServer(workdir, cluster_args, port=port))

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
