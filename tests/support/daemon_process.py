"""A ``kvfabric serve`` child process for tests and benchmarks.

:class:`DaemonProcess` starts the daemon on a data directory with HTTP on a free loopback
port (``http.port=0``), waits for its ready file within the caller's deadline, and stops it
with SIGTERM (:meth:`~DaemonProcess.stop`, the exit code is the caller's to check) or
SIGKILL (:meth:`~DaemonProcess.kill`, also what leaving a ``with`` block does). The process
is a :class:`child_process.Child`: a process group of its own that dies with its parent, and
nothing of that group outlives a stop or a kill. Its output is appended to
``data_dir/daemon.log``; a failed start raises ``RuntimeError`` quoting its tail.

``start`` may be called again after a stop or a kill: same data directory and settings, new
ports (``info`` is the new ready file). Start it from the thread that keeps running while the
daemon should (see :mod:`child_process`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from child_process import Child


class DaemonProcess:
    """A ``kvfabric serve`` child on ``data_dir``; ``settings`` are ``--set`` items,
    ``cli_args`` the command line's own flags (before ``serve``: ``--log-format json``)."""

    def __init__(
        self, data_dir: Path, settings: Sequence[str] = (), cli_args: Sequence[str] = ()
    ) -> None:
        self.data_dir = data_dir
        self.settings = list(settings)
        self.cli_args = list(cli_args)
        self.child: Child | None = None
        self.info: dict[str, Any] = {}  # the ready file: socket, http_port, tcp_port, ...

    @property
    def proc(self) -> subprocess.Popen | None:
        return None if self.child is None else self.child.proc

    @property
    def socket(self) -> str:
        return self.info["socket"]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "daemon.log"

    def start(self, timeout: float = 60.0) -> Self:
        """Start the daemon and wait (``timeout`` seconds at most) until it serves."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ready = self.data_dir / "ready.json"
        ready.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "kvfabric.cli",
            *self.cli_args,
            "serve",
            "--ready-file",
            str(ready),
            "--set",
            f"store.data_dir={self.data_dir}",
            "--set",
            "http.host=127.0.0.1",
            "--set",
            "http.port=0",
        ]
        for item in self.settings:
            argv += ["--set", item]
        child = self.child = Child(self.data_dir.name, argv, self.log_path).start()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if not child.alive:
                code = child.kill()
                raise RuntimeError(f"daemon exited {code} ({self.data_dir}): {self.read_log()}")
            if time.monotonic() > deadline:
                child.kill()
                raise RuntimeError(f"daemon not ready in {timeout}s: {self.read_log()}")
            time.sleep(0.02)
        self.info = json.loads(ready.read_text())
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the daemon drains and persists), then its exit code; a daemon still
        running after ``timeout`` seconds is killed and ``subprocess.TimeoutExpired`` raised."""
        assert self.child is not None, "the daemon was never started"
        return self.child.stop(timeout)

    def kill(self) -> None:
        """SIGKILL the daemon and its process group (nothing if it is not running)."""
        if self.child is not None:
            self.child.kill()

    def read_log(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
