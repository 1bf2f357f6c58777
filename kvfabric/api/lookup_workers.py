"""Large ``/v1/lookup`` bodies parsed by worker processes, off the daemon's process.

Why a process: parsing and checking a million token ids costs the better part of a second of
CPU. On a thread of the daemon it held the GIL in stretches of a few milliseconds back to
back, and every syscall of the control plane's loop (accept, recv, send) then waited up to
the interpreter's switch interval to get it back: under a stream of such requests control
pings reached p99 126-295 ms and the control socket accepted too slowly to keep its queue
from filling. In a process of its own the parse costs the daemon one write and one read of a
pipe, and the OS, not the GIL, shares the CPU.

Contract:

* :meth:`LookupParsers.parse` (async, on the HTTP loop) returns what
  :func:`kvfabric.api.lookup_body.parse_lookup` returns for the body, and raises the same
  errors (:class:`~kvfabric.api.lookup_body.BodyInvalid`,
  :class:`~kvfabric.api.lookup_body.BodyTooLarge`); the token ids of a body parsed by a
  worker come back as a read-only int32 numpy array instead of a list.
* :meth:`LookupParsers.run` gives the parsed body to the caller's function on a thread of
  the daemon: a small body is parsed on that same thread, in the same hop off the loop.
* A body of at most :data:`IN_PROCESS_BYTES` (a prompt of a few thousand tokens) is parsed on
  a thread of the daemon: less work than the request's own handling. A larger one goes to one
  of ``workers`` processes (``limits.http_parse_workers``), each parsing one body at a time;
  more requests wait for a free one without holding a thread. ``workers=0`` parses every body
  on a thread of the daemon.
* A worker starts on first use (``python -m kvfabric.api.lookup_workers SETTINGS``) and talks
  over one socketpair (one descriptor in the daemon); it exits when that closes: the daemon
  ended, :meth:`LookupParsers.close`, or it was idle for ``idle_s`` (:data:`IDLE_S`; an idle
  daemon holds no worker, nor the memory a million-id body left one). A worker that dies or
  does not answer within ``answer_s`` (:data:`ANSWER_S`) is killed and replaced on next use;
  its request gets :class:`~kvfabric.errors.UnavailableError` (503).
* Workers run at a lower priority than the daemon (:data:`WORKER_NICE`): the control plane
  comes first on a busy host.
* The socket carries bytes, never pickle: a request is ``u32le length`` + the body; a reply
  is ``u32le length`` + a JSON header, then, for ``{"ok": ..., "tokens": n}``, ``n`` int32
  little-endian token ids. The header is ``{"ok": body less its long lists, "tokens": n or
  null, "chunk_hashes": list or null}``, ``{"too_large": message}``, ``{"invalid": issues,
  "total": n}`` or ``{"failed": what}`` (a bug: the request gets a 500, the worker lives on).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

# the worker process imports this module: nothing here may pull in pydantic, asyncio, numpy
# or prometheus_client at import (a worker starts in ~0.1 s and ~12 MB, not 0.8 s and 33 MB)
from kvfabric.api.lookup_body import BodyInvalid, BodyTooLarge, build, parse_body, parse_lookup
from kvfabric.errors import KVFabricError, UnavailableError

if TYPE_CHECKING:
    import asyncio

    from pydantic import BaseModel

IN_PROCESS_BYTES = 32 << 10
ANSWER_S = 60.0  # a worker that takes longer on one body is stuck: killed
IDLE_S = 5.0  # a worker idle this long ends (the next large body starts one: ~0.1 s)
# Workers run this much nicer than the daemon: a stream of million-id bodies keeps them busy,
# and on a busy host the control loop, not the parsing, must get the CPU first (at the
# daemon's own priority two busy workers left its loop runnable but waiting 70-80% of the
# time, and new sessions waited seconds behind the accept queue).
WORKER_NICE = 10
_LEN = struct.Struct("<I")

Model = TypeVar("Model", bound="BaseModel")
Result = TypeVar("Result")


class LookupParsers:
    """Parses lookup bodies; see the module docstring. Thread-safe."""

    def __init__(
        self,
        workers: int,
        *,
        max_tokens: int,
        max_hashes: int,
        hash_chars: int,
        answer_s: float = ANSWER_S,
        idle_s: float = IDLE_S,
    ) -> None:
        self.workers = workers
        self.answer_s, self.idle_s = answer_s, idle_s
        self._limits = {
            "max_tokens": max_tokens,
            "max_hashes": max_hashes,
            "hash_chars": hash_chars,
        }
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._started = 0  # workers alive or being started
        self._cond = threading.Condition()
        self._closed = False
        self._limiter: Any = None  # anyio.CapacityLimiter(workers), made in the HTTP loop
        self._retire: asyncio.TimerHandle | None = None  # the next idle check, on that loop

    async def parse(self, raw: bytes, model: type[Model]) -> Model:
        """``raw`` (already size-capped) parsed and checked; see the module docstring."""
        import anyio.to_thread  # starlette's own dependency; here only where it is used

        if self._here(raw):
            return await anyio.to_thread.run_sync(lambda: self._parse_here(raw, model))
        return await self._parse_in_worker(raw, model)

    async def run(self, raw: bytes, model: type[Model], fn: Callable[[Model], Result]) -> Result:
        """``fn`` of the parsed body, on a thread of the daemon: a small body is parsed on
        that same thread (one hop off the loop, not two: each hop is a thread wake-up, and on
        a busy host a wait for a core), a large one first in a worker (:meth:`parse`)."""
        import anyio.to_thread

        if self._here(raw):
            return await anyio.to_thread.run_sync(lambda: fn(self._parse_here(raw, model)))
        return await anyio.to_thread.run_sync(fn, await self._parse_in_worker(raw, model))

    def _here(self, raw: bytes) -> bool:
        """Whether ``raw`` is parsed on a thread of the daemon, not by a worker."""
        return self.workers <= 0 or len(raw) <= IN_PROCESS_BYTES

    def _parse_here(self, raw: bytes, model: type[Model]) -> Model:
        return parse_lookup(raw, model, **self._limits)

    async def _parse_in_worker(self, raw: bytes, model: type[Model]) -> Model:
        import asyncio

        import anyio
        import anyio.to_thread

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.workers)
        # as many threads as workers: the other requests wait here, holding no thread
        try:
            data, lists = await anyio.to_thread.run_sync(
                self._in_worker, raw, limiter=self._limiter
            )
        finally:
            if self._retire is None:
                self._retire = asyncio.get_running_loop().call_later(self.idle_s, self._retire_idle)
        return build(model, data, lists)

    def _retire_idle(self) -> None:
        """On the HTTP loop: end the workers idle for ``idle_s``; again while any is idle."""
        import asyncio

        self._retire = None
        now = time.monotonic()
        with self._cond:
            old = [w for w in self._idle if now - w.last_used >= self.idle_s]
            self._idle = [w for w in self._idle if w not in old]
            self._started -= len(old)
            self._live.difference_update(old)
            left = min((w.last_used for w in self._idle), default=None)
        loop = asyncio.get_running_loop()
        for worker in old:
            loop.run_in_executor(None, worker.stop)  # it exits at EOF; stop() reaps it
        if left is not None:
            self._retire = loop.call_later(max(0.1, left + self.idle_s - now), self._retire_idle)

    def parse_blocking(self, raw: bytes) -> tuple[Any, dict[str, Any]]:
        """What :meth:`parse` does with a large body, minus the model, on the calling thread
        (tests; waits for a free worker)."""
        return self._in_worker(raw)

    def close(self) -> None:
        """End every worker (idle ones now; busy ones when they finish their body)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._started -= len(idle)
            self._live.difference_update(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()

    def pids(self) -> list[int]:
        """The worker processes' ids, busy or idle (tests)."""
        with self._cond:
            return [w.proc.pid for w in self._live]

    # ------------------------------------------------------------------ internals
    def _in_worker(self, raw: bytes) -> tuple[Any, dict[str, Any]]:
        worker = self._take()
        try:
            header, tokens = worker.ask(raw, self.answer_s)
        except BaseException:
            worker.kill()
            self._give_back(None, worker)
            raise
        self._give_back(worker)
        if "too_large" in header:
            raise BodyTooLarge(header["too_large"])
        if "invalid" in header:
            raise BodyInvalid(header["invalid"], header["total"])
        if "failed" in header:
            raise KVFabricError(f"internal error parsing the body: {header['failed']}")
        lists: dict[str, Any] = {}
        if tokens is not None:
            lists["token_ids"] = tokens
        if header.get("chunk_hashes") is not None:
            lists["chunk_hashes"] = header["chunk_hashes"]
        return header["ok"], lists

    def _take(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise UnavailableError("the daemon is shutting down")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive:
                        return worker
                    worker.kill()  # died while idle: replace it
                    self._live.discard(worker)
                    self._started -= 1
                if self._started < max(1, self.workers):
                    self._started += 1
                    break
                self._cond.wait()
        try:
            worker = _Worker.start(self._limits)
        except BaseException:
            self._give_back(None)
            raise
        with self._cond:
            self._live.add(worker)
        return worker

    def _give_back(self, worker: _Worker | None, dead: _Worker | None = None) -> None:
        """``worker`` back to the idle ones; None: a worker slot freed (``dead``: its worker,
        killed)."""
        with self._cond:
            if worker is not None and not self._closed:
                worker.last_used = time.monotonic()
                self._idle.append(worker)
            else:
                self._started -= 1
                for gone in (worker, dead):
                    if gone is not None:
                        self._live.discard(gone)
            self._cond.notify()
            closed = self._closed
        if worker is not None and closed:
            worker.stop()


class _Worker:
    """One worker process and the daemon's end of its socketpair."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.last_used = time.monotonic()

    @classmethod
    def start(cls, limits: dict[str, int]) -> _Worker:
        mine, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvfabric.api.lookup_workers", json.dumps(limits)],
                stdin=theirs.fileno(),
                stdout=theirs.fileno(),
                close_fds=True,
            )
        except OSError as exc:
            mine.close()
            raise UnavailableError(f"cannot start a lookup parser process: {exc}") from None
        finally:
            theirs.close()
        return cls(proc, mine)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, raw: bytes, answer_s: float) -> tuple[dict[str, Any], Any]:
        """Send one body, read its reply within ``answer_s``: (header, token ids as an int32
        array or None)."""
        deadline = time.monotonic() + answer_s
        try:
            self.sock.settimeout(answer_s)
            self.sock.sendall(_LEN.pack(len(raw)))
            self.sock.sendall(raw)
            (size,) = _LEN.unpack(self._read(_LEN.size, deadline))
            header = json.loads(self._read(size, deadline))
            count = header.get("tokens")
            tokens = None
            if count is not None:
                import numpy as np  # the daemon has it loaded; the worker never needs it

                tokens = np.frombuffer(self._read(4 * count, deadline), dtype="<i4")
            return header, tokens
        except (OSError, ValueError, struct.error) as exc:
            raise UnavailableError(f"the lookup parser process failed: {exc!r}") from None

    def _read(self, n: int, deadline: float) -> bytearray:
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("the lookup parser process ended")
            got += k
        return out

    def stop(self) -> None:
        """Close its socket (it exits on EOF); killed if it has not within a second."""
        self.sock.close()
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------- the worker process


def _serve(limits: dict[str, int]) -> None:
    """The worker loop: bodies in on stdin, replies out on stdout, until EOF."""
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)
    sock = socket.socket(fileno=os.dup(0))
    os.close(0)
    os.close(1)
    os.open(os.devnull, os.O_RDWR)  # fds 0 and 1 no longer the socket: a stray print is harmless
    os.dup2(0, 1)
    while True:
        head = _recv_exactly(sock, _LEN.size)
        if head is None:
            return
        body = _recv_exactly(sock, _LEN.unpack(head)[0])
        if body is None:
            return
        tokens = b""
        try:
            data, lists = parse_body(body, **limits)
            ids = lists.get("token_ids")
            header: dict[str, Any] = {
                "ok": data,
                "tokens": None if ids is None else len(ids),
                "chunk_hashes": lists.get("chunk_hashes"),
            }
            if ids is not None:
                tokens = array("i", ids).tobytes()  # checked int32 above
                if sys.byteorder != "little":
                    swapped = array("i", ids)
                    swapped.byteswap()
                    tokens = swapped.tobytes()
        except BodyTooLarge as exc:
            header = {"too_large": str(exc)}
        except BodyInvalid as exc:
            header = {"invalid": exc.issues, "total": exc.total}
        except Exception as exc:  # a bug: this body's request fails (500), the worker lives
            header = {"failed": f"{type(exc).__name__}: {exc}"}
        del body
        text = json.dumps(header).encode()
        try:
            sock.sendall(_LEN.pack(len(text)) + text)
            if tokens:
                sock.sendall(tokens)
        except OSError:
            return  # the daemon is gone (killed while this body was parsed)


def _recv_exactly(sock: socket.socket, n: int) -> bytearray | None:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            return None
        got += k
    return out


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
