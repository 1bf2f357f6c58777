"""Child processes of the tests and the benchmarks (daemons, redis-servers, engine jobs,
client workers), none of which may outlive whoever started them, and loopback ports for them.

Contract:

* every child runs in a process group of its own (``start_new_session``), so a signal for it
  (kill -9, SIGSTOP, SIGCONT) reaches it and whatever it started, and nothing else;
* every child gets ``PR_SET_PDEATHSIG = SIGKILL`` before it execs (a tiny launcher,
  :data:`LAUNCH`), so even a parent killed by SIGKILL leaves none behind. The kernel sends
  that signal when the *thread* that forked the child exits: start children from the main
  thread (or one that lives as long as they do);
* :meth:`Child.stop` and :meth:`Child.kill` end the whole group and reap the child;
  :func:`kill_all` (registered with ``atexit``) kills every child still alive;
* a child's output is appended to its ``log_path``; :meth:`Child.tail` is what a failure
  message quotes;
* ``/proc`` readings of a child (:meth:`Child.memory_mb`, :meth:`Child.fd_targets`, ...) are
  what the chaos harness's memory and descriptor invariants are computed from.

Used by :mod:`daemon_process`, :mod:`redis_process`, :mod:`engine_jobs`, the chaos harness
and (through ``benchmarks/_common.py``, which puts this folder on ``sys.path``) the benchmarks.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from signal import SIGKILL, SIGTERM

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
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name, self.argv, self.log_path, self.env, self.cwd = name, argv, log_path, env, cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, str(os.getpid()), *self.argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
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
        """``sig`` to the whole group (nothing if the child is gone)."""
        if self.alive:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float, sig: int = SIGTERM) -> int:
        """``sig`` to the child alone, then its exit code once it has exited; whatever it
        left in its group is killed before it is reaped. If it is still running after
        ``timeout`` seconds the group is killed and ``subprocess.TimeoutExpired`` raised."""
        assert self.proc is not None, f"{self.name} was never started"
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        if not self.exited(timeout):
            self.kill()
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self.kill()

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL the whole group (a stopped process dies of it too) and reap the child;
        returns its exit code."""
        if self.proc is None:
            return 0
        if self.proc.returncode is None:
            # Not reaped yet, so the group id cannot belong to anyone else: members the
            # child left behind die with it even when it has exited already.
            try:
                os.killpg(self.pid, SIGKILL)
            except ProcessLookupError:
                pass
        code = self.proc.wait(timeout)
        with _live_lock:
            _live.discard(self)
        return code

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds (a child it
        reaps is forgotten: what it left in its group is no longer :meth:`kill`'s)."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        with _live_lock:
            _live.discard(self)
        return code

    def exited(self, timeout: float) -> bool:
        """Whether the child exits within ``timeout`` seconds. It is left unreaped (unlike
        :meth:`wait`), so :meth:`kill` still reaches whatever it left in its group."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.returncode is None:
            try:
                flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
                if os.waitid(os.P_PID, self.pid, flags) is not None:
                    return True
            except ChildProcessError:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

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


def live_children() -> frozenset[Child]:
    """The children alive now (a harness passes them to :func:`kill_all` as ``keep``)."""
    with _live_lock:
        return frozenset(_live)


def kill_all(keep: frozenset[Child] = frozenset()) -> None:
    """Kill every live child but those in ``keep`` (e.g. a session's servers started before
    a harness that cleans up after itself)."""
    with _live_lock:
        children = [child for child in _live if child not in keep]
    for child in children:
        try:
            child.kill()
        except Exception:
            pass


atexit.register(kill_all)


def free_port() -> int:
    """A TCP port free on loopback right now (a child started next may listen on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
