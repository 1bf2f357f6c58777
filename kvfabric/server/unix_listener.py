"""The control socket's Unix listener: drains its accept queue and screens each connection
before it costs the daemon a transport, a reader and a task.

Why: asyncio's and uvloop's servers build a transport, a StreamReader and a task for every
connection they accept (~0.15 ms of the loop's CPU), before the daemon may look at it. A
flood that keeps a thousand connections in the accept queue then holds a new client's
connection behind a thousand of those on a busy host: the chaos suite's new sessions took
1-3 s. Here a connection costs an accept, a ``getsockopt`` and a peek until it is worth more.

Contract (on the event loop):

* :class:`UnixListener` binds ``path`` (mode 0660: the node's engines run as the daemon's
  group) and listens with ``backlog``. At each wakeup it accepts up to :data:`BATCH`
  connections (the loop serves the others between batches: ~2 ms each on a busy host);
* each is looked at (``look``: :meth:`kvfabric.server.admission.Admission.look`): one whose
  hello is waiting is handed to ``adopt`` at once; a silent or partial one is held while the
  queue still has connections, and the held ones are trimmed to the pending bounds (``trim``:
  the older ones beyond them are refused, unread, as they would be pushed out); what is held
  is adopted once the queue is empty, or after :data:`HOLD_ROUNDS` batches;
* out of descriptors (EMFILE / ENFILE) accepting pauses :data:`PAUSE_S` (what is held is
  adopted), logged at most every 10 s; other accept errors cost that connection only;
* :meth:`close` stops accepting and closes the socket and what is held; the socket file is
  the caller's.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

BATCH = 32
HOLD_ROUNDS = 64  # at most BATCH * HOLD_ROUNDS connections accepted before the held are served
PAUSE_S = 0.1
_LOG_EVERY_S = 10.0

Looked = list[tuple[socket.socket, str, bool]]  # (connection, peer, its hello is waiting)
Held = list[tuple[socket.socket, str]]


class UnixListener:
    def __init__(
        self,
        path: str,
        backlog: int,
        loop: asyncio.AbstractEventLoop,
        look: Callable[[list[socket.socket]], Looked],
        trim: Callable[[Held], Held],
        adopt: Callable[[socket.socket], None],
    ) -> None:
        self._loop, self._look, self._trim, self._adopt = loop, look, trim, adopt
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o660)
            self._sock.listen(backlog)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self._held: Held = []
        self._rounds = 0
        self._closed = False
        self._last_log = float("-inf")
        loop.add_reader(self._sock.fileno(), self._ready)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for sock, _ in self._held:
            sock.close()
        self._held = []

    def _ready(self) -> None:
        batch: list[socket.socket] = []
        drained = False
        while len(batch) < BATCH:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                drained = True
                break
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause(exc)
                    drained = True
                    break
                continue  # ECONNABORTED and the like: that client only
            conn.setblocking(False)
            batch.append(conn)
        for sock, peer, waiting in self._look(batch):
            if waiting:
                self._adopt(sock)
            else:
                self._held.append((sock, peer))
        if self._held:
            self._held = self._trim(self._held)
        self._rounds += 1
        if drained or self._rounds >= HOLD_ROUNDS:
            held, self._held, self._rounds = self._held, [], 0
            for sock, _ in held:
                self._adopt(sock)

    def _pause(self, exc: OSError) -> None:
        """Out of descriptors: stop reading the queue a moment (it would wake us at once)."""
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("control socket: cannot accept (%s); pausing %g s", exc, PAUSE_S)
        self._loop.remove_reader(self._sock.fileno())
        self._loop.call_later(PAUSE_S, self._resume)

    def _resume(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._ready)
