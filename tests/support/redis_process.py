"""A ``redis-server`` child process for tests and benchmarks: no persistence, on a loopback
port (a free one unless given), ready when it answers PING within the caller's deadline.

:meth:`RedisServer.restart` brings it back empty on the same port (what a node's link to its
global index must survive). The process is a :class:`child_process.Child` (a process group
of its own that dies with its parent); its output goes to ``workdir/redis-PORT.log``, whose
tail a failed start quotes. A missing binary raises ``RuntimeError`` at construction.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Self

import redis
from child_process import Child, free_port


class RedisServer:
    """One redis-server child without persistence; ``extra_args`` go on its command line."""

    def __init__(
        self, workdir: Path, extra_args: tuple[str, ...] = (), port: int | None = None
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not on PATH: install it (e.g. apt-get install redis-server) "
                "to run the global index tests and benchmarks"
            )
        self.binary, self.workdir = binary, workdir
        self.port = free_port() if port is None else port
        self.extra_args = extra_args
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> Self:
        """Start the server and wait (``timeout`` seconds at most) until it answers PING."""
        argv = [
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
        ]
        log_path = self.workdir / f"redis-{self.port}.log"
        self.child = Child(f"redis-{self.port}", argv, log_path).start()
        client = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.exceptions.ConnectionError:
                    if not self.child.alive or time.monotonic() > deadline:
                        tail = self.child.tail()
                        self.child.kill()
                        raise RuntimeError(
                            f"redis-server did not start on port {self.port}: {tail}"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
