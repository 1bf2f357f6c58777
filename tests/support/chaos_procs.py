"""Child processes of the chaos harness (:mod:`chaos_harness`): daemons, a redis-server and
client workers, none of which may outlive the harness.

Contract:

* every child runs in a process group of its own (``start_new_session``), so a signal for it
  (kill -9, SIGSTOP, SIGCONT) reaches it and whatever it started, and nothing else;
* every child gets ``PR_SET_PDEATHSIG = SIGKILL`` before it execs (a tiny launcher,
  :data:`LAUNCH`), so even a harness killed by SIGKILL leaves none behind. The kernel sends
  that signal when the *thread* that forked the child exits: start children from the main
  thread (or one that lives as long as they do);
* :func:`kill_all` (registered with ``atexit``) kills every group still alive; each
  :class:`Child` is also killed by its owner's ``finally``;
* ``/proc`` readings of a child (:meth:`Child.rss_mb`, :meth:`Child.fd_targets`) are what the
  harness's memory and descriptor invariants are computed from.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis
from redis_servers import free_port

# Sets the parent-death signal, checks the parent is still there (it may have died before
# prctl ran), then becomes the real program (same pid, same process group).
LAUNCH = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

_live: set[Child] = set()
_live_lock = threading.Lock()


class Child:
    """One launched program in its own process group, its output appended to ``log_path``."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, str(os.getpid()), *self.argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        with _live_lock:
            _live.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the whole group and reap it (a stopped process dies of SIGKILL too)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout)
        with _live_lock:
            _live.discard(self)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        with _live_lock:
            _live.discard(self)
        return code

    def memory_mb(self) -> dict[str, float]:
        """``VmRSS`` and its parts (``RssAnon``: the heap; ``RssShmem``: shared memory such
        as the arenas) from /proc/PID/status, in MiB; empty if the process is gone."""
        out = {}
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[name] = int(rest.split()[0]) / 1024
        except (OSError, ValueError):
            return {}
        return out

    def cpu_s(self) -> float | None:
        """User + system CPU seconds the process has used (/proc/PID/stat)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def fd_targets(self) -> list[str]:
        """What each open descriptor points at (``socket:[n]``, a path, ``anon_inode:...``)."""
        out = []
        try:
            names = os.listdir(f"/proc/{self.pid}/fd")
        except OSError:
            return out
        for name in names:
            try:
                out.append(os.readlink(f"/proc/{self.pid}/fd/{name}"))
            except OSError:
                pass
        return out

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def kill_all() -> None:
    with _live_lock:
        children = list(_live)
    for child in children:
        try:
            child.kill()
        except Exception:
            pass


atexit.register(kill_all)


class Daemon:
    """A ``kvfabric serve`` child on ``data_dir``; restarts keep the directory, the socket
    path and the settings (HTTP and TCP ports are new each time: ``http_url`` follows)."""

    def __init__(self, name: str, data_dir: Path, settings: list[str], admin_token: str) -> None:
        self.name, self.data_dir, self.settings = name, data_dir, settings
        self.admin_token = admin_token
        self.child: Child | None = None
        self.info: dict[str, Any] = {}
        self.incarnation = 0
        self.ready = False  # serving (between a start's ready file and the next kill)

    @property
    def socket(self) -> str:
        return str(self.data_dir / "kvfabric.sock")

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}"

    def start(self, timeout: float = 90.0) -> Daemon:
        ready = self.data_dir / "ready.json"
        ready.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "kvfabric.cli",
            "serve",
            "--ready-file",
            str(ready),
            "--set",
            f"store.data_dir={self.data_dir}",
            "--set",
            "http.host=127.0.0.1",
            "--set",
            "http.port=0",
            "--set",
            f"socket_path={self.socket}",
        ]
        for item in self.settings:
            argv += ["--set", item]
        self.ready = False
        self.incarnation += 1
        self.child = Child(self.name, argv, self.data_dir / "daemon.log").start()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if not self.child.alive or time.monotonic() > deadline:
                tail = self.child.tail()
                self.child.kill()
                raise RuntimeError(f"daemon {self.name} did not come up:\n{tail}")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        self.ready = True
        return self

    def kill9(self) -> None:
        assert self.child is not None
        self.ready = False
        self.child.kill()

    def http(
        self,
        method: str,
        path: str,
        *,
        token: str | None = "admin",
        timeout: float = 10,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request (``token="admin"``: the admin token; None: no Authorization)."""
        token = self.admin_token if token == "admin" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(
            method, f"{self.http_url}{path}", headers=headers, timeout=timeout, **kwargs
        )

    def stats(self, timeout: float = 10) -> dict[str, Any]:
        response = self.http("GET", "/v1/stats", timeout=timeout)
        response.raise_for_status()
        return response.json()

    def health(self, timeout: float = 5) -> str:
        return str(self.http("GET", "/healthz", token=None, timeout=timeout).json()["status"])


class Redis:
    """A ``redis-server`` child without persistence on a free loopback port; ``restart``
    brings it back empty on the same port (what a node's cluster link must survive)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH (apt-get install redis-server)")
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Redis:
        self.child = Child(
            "redis",
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
            ],
            self.workdir / "redis.log",
        ).start()
        client = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 15
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.exceptions.ConnectionError:
                    if not self.child.alive or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server did not start on {self.port}: {self.child.tail()}"
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
