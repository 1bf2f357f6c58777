"""The control socket's Unix listener: drains its accept queue at every wakeup and screens
each connection before it costs the daemon a transport, a reader and a task.

Why: asyncio's and uvloop's servers build a transport, a StreamReader and a task for every
connection they accept (~0.15 ms of the loop's CPU), before the daemon may look at it. A
flood that keeps a thousand connections in the accept queue then holds a new client's
connection behind a thousand of those on a busy host: the chaos suite's new sessions took
1-3 s. Here a connection costs an accept, a ``getsockopt`` and a peek until it is worth more.

Contract (on the event loop):

* :class:`UnixListener` binds ``path`` (mode 0660: the node's engines run as the daemon's
  group) and listens with ``backlog``; at every wakeup it accepts until the queue is empty,
  :data:`BATCH` at a time (the loop runs between batches);
* each batch goes through ``screen`` (:meth:`kvfabric.server.admission.Admission.screen`),
  which refuses at once a connection the admission rules would refuse or push out before
  reading it, and returns the others, in accept order, to be handed to ``adopt``;
* out of descriptors (EMFILE / ENFILE) accepting pauses :data:`PAUSE_S`, logged at most every
  10 s; other accept errors (a client that left) cost that connection only;
* :meth:`close` stops accepting and closes the socket; the socket file is the caller's.
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

BATCH = 1024
PAUSE_S = 0.1
_LOG_EVERY_S = 10.0


class UnixListener:
    def __init__(self, path: str, backlog: int, loop: asyncio.AbstractEventLoop,
                 screen: Callable[[list[socket.socket]], list[socket.socket]],
                 adopt: Callable[[socket.socket], None]) -> None:
        self._loop, self._screen, self._adopt = loop, screen, adopt
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o660)
            self._sock.listen(backlog)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self._closed = False
        self._last_log = float("-inf")
        loop.add_reader(self._sock.fileno(), self._ready)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    def _ready(self) -> None:
        batch: list[socket.socket] = []
        while len(batch) < BATCH:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause(exc)
                    break
                continue  # ECONNABORTED and the like: that client only
            conn.setblocking(False)
            batch.append(conn)
        if not batch:
            return
        for conn in self._screen(batch):
            self._adopt(conn)

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
