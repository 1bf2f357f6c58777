"""Admission to the control socket: who may hold a connection, and for how long.

A connection is *pending* from accept until its ``hello`` is processed, then a *session*.
The limits (``limits.control_*`` in :mod:`kvfabric.config`) make sure that a flood of idle,
slow or half-sent connections never locks a legitimate client out:

- pending connections are bounded in total (``control_max_pending``) and per peer
  (``control_max_pending_per_peer``). At a bound the pending connection (of that peer, or
  overall) that has been *silent the longest* (no bytes since it was accepted, or since its
  last bytes) is closed to make room, never the new one, and never one whose first frame is
  already waiting to be read (in the daemon's buffer, or in the kernel's: a non-blocking
  ``MSG_PEEK``), because reading it settles that connection at once. A client that says hello
  right after connecting always gets in, however many connections a flood from the same uid
  or address opened just before or after it; a flood only pushes out connections that stay
  silent, its own first (reasons ``per_peer_limit``, ``pending_overflow``). Unix connections
  accepted while the accept queue is drained are screened first (:meth:`Admission.look`,
  :meth:`Admission.trim`): those these rules would push out unread are refused before they
  cost a transport;
- a pending connection is closed at its hello deadline (``control_hello_timeout_s`` after
  accept; reason ``hello_timeout``), and may send at most ``control_hello_max_bytes`` before
  it (the control server reads with that frame limit; ``frame_too_large``);
- ``max_sessions`` counts sessions only (pending connections are bounded above instead);
  a hello over it, or over the peer's ``control_max_sessions_per_peer``, is refused with
  :class:`~kvfabric.errors.UnavailableError` (``max_sessions``, ``per_peer_limit``);
- a session with no open lease, no request in flight and no traffic (bytes received or a
  reply sent) for ``control_idle_timeout_s`` is closed (``idle``; 0 turns this off). A
  session holding leases is never idle-closed: its leases end at their own deadlines (the
  store's), and the client may still be reading or writing the pages they cover.

A peer is the connecting uid on the Unix socket (``SO_PEERCRED``) and the source address on
TCP. Every connection the daemon refuses or closes is counted
(``kvfabric_control_connections_closed_total{listener, reason}``) and summed up in one
warning line at most every :data:`LOG_EVERY_S` seconds, so a flood cannot flood the log.

Used on the event loop only (no locks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvfabric.config import Limits
from kvfabric.errors import (
    DeadlineExceededError,
    FrameTooLargeError,
    KVFabricError,
    UnavailableError,
)
from kvfabric.protocol.frames import encode_frame
from kvfabric.protocol.messages import error_reply
from kvfabric.server.session import Session

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
PEEK_BYTES = 4096  # a hello frame (a token and a client name) fits many times
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_FRAME_LEN = struct.Struct("<I")  # kvfabric.protocol.frames: u32le body length
_PER_PEER_FULL = UnavailableError(
    "too many connections from this peer are waiting for hello; "
    "the one silent the longest is closed"
)
_PENDING_FULL = UnavailableError(
    "too many connections are waiting for hello; the one silent the longest is closed"
)


class CountingReader(asyncio.StreamReader):
    """A StreamReader that knows how many bytes it holds that nobody has read yet (the
    transport may read a connection's hello before the connection's task runs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fed = 0
        self.taken = 0

    def feed_data(self, data: bytes) -> None:  # type: ignore[override]  # asyncio passes bytes
        self.fed += len(data)
        super().feed_data(data)

    async def read(self, n: int = -1) -> bytes:
        data = await super().read(n)
        self.taken += len(data)
        return data

    @property
    def unread(self) -> int:
        return self.fed - self.taken


@dataclass(eq=False)
class Conn:
    """One accepted control connection, pending or a session."""

    writer: asyncio.StreamWriter
    listener: str  # "unix" or "tcp": the metrics' label
    peer: str  # "uid:1000", "ip:10.0.0.7"
    accepted: float
    last_active: float
    reader: CountingReader | None = field(default=None, repr=False)
    session: Session | None = None
    in_flight: int = 0  # requests read and not yet answered
    closing: bool = False
    frame_waiting: bool = False  # a whole first frame seen waiting: never pushed out
    deadline: asyncio.TimerHandle | None = field(default=None, repr=False)

    def touch(self) -> None:
        self.last_active = time.monotonic()


class Admission:
    """Tracks pending connections and sessions; closes the ones the limits say must go."""

    def __init__(self, limits: Limits, metrics: Any) -> None:
        self._limits = limits
        self._metrics = metrics
        # in order of their last bytes (or accept): the first has been silent the longest
        self._pending: dict[Conn, None] = {}
        self._pending_by_peer: dict[str, dict[Conn, None]] = {}
        self._sessions: dict[Conn, None] = {}
        self._sessions_by_peer: Counter[str] = Counter()
        self._unlogged: Counter[tuple[str, str]] = Counter()
        self._last_log = float("-inf")

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def sessions(self) -> list[Conn]:
        return list(self._sessions)

    def accept(
        self, writer: asyncio.StreamWriter, *, local: bool, reader: CountingReader | None = None
    ) -> Conn:
        """Register a new connection as pending (closing the longest-silent pending one at a
        bound) and arm its hello deadline. ``reader``: the connection's, so that bytes it
        holds unread count as the connection speaking."""
        now = time.monotonic()
        conn = Conn(writer, "unix" if local else "tcp", peer_of(writer, local), now, now, reader)
        mine = self._pending_by_peer.setdefault(conn.peer, {})
        if len(mine) >= self._limits.control_max_pending_per_peer:
            self._push_out(mine, "per_peer_limit", _PER_PEER_FULL)
        if len(self._pending) >= self._limits.control_max_pending:
            self._push_out(self._pending, "pending_overflow", _PENDING_FULL)
        self._pending[conn] = None
        mine[conn] = None
        conn.deadline = asyncio.get_running_loop().call_later(
            self._limits.control_hello_timeout_s, self._hello_expired, conn
        )
        self._metrics.control_pending(len(self._pending))
        return conn

    def look(self, batch: list[socket.socket]) -> list[tuple[socket.socket, str, bool]]:
        """Unix connections just accepted, before they cost a transport: each one's peer and
        whether its whole first frame is waiting (a client's hello); one whose first frame is
        announced over ``control_hello_max_bytes`` is refused right here (``frame_too_large``),
        as its first read would."""
        limit = self._limits.control_hello_max_bytes
        looked: list[tuple[socket.socket, str, bool]] = []
        for sock in batch:
            first = _peek(sock)
            waiting = False
            if first is not None and len(first) >= _FRAME_LEN.size:
                (length,) = _FRAME_LEN.unpack_from(first)
                if length > limit:
                    self._refuse_socket(
                        sock,
                        "frame_too_large",
                        FrameTooLargeError(f"frame of {length} bytes exceeds the limit {limit}"),
                    )
                    continue
                waiting = _FRAME_LEN.size + length <= len(first)
            looked.append((sock, peer_of_socket(sock), waiting))
        return looked

    def trim(self, quiet: list[tuple[socket.socket, str]]) -> list[tuple[socket.socket, str]]:
        """Silent or partial Unix connections not served yet, in accept order: the newest are
        kept, up to the pending bounds per peer and overall, and returned in order; the older
        ones beyond them would be the longest silent once the newer ones are served, pushed
        out unread: they are refused now (``per_peer_limit``, ``pending_overflow``)."""
        per_peer: Counter[str] = Counter()
        kept: list[tuple[socket.socket, str]] = []
        for sock, peer in reversed(quiet):  # newest first: they are silent the least
            if per_peer[peer] >= self._limits.control_max_pending_per_peer:
                self._refuse_socket(sock, "per_peer_limit", _PER_PEER_FULL)
            elif len(kept) >= self._limits.control_max_pending:
                self._refuse_socket(sock, "pending_overflow", _PENDING_FULL)
            else:
                per_peer[peer] += 1
                kept.append((sock, peer))
        kept.reverse()
        return kept

    def _refuse_socket(self, sock: socket.socket, reason: str, error: KVFabricError) -> None:
        """Close a Unix connection no transport serves yet, saying why (best effort: a
        non-blocking send), and count it."""
        with contextlib.suppress(OSError):
            sock.send(encode_frame(error_reply(0, error)), socket.MSG_DONTWAIT)
        sock.close()
        self._count_listener("unix", reason)

    def heard(self, conn: Conn) -> None:
        """Bytes came in on ``conn``: its silence starts again (a pending one goes to the
        back of the line to be pushed out)."""
        conn.touch()
        conn.frame_waiting = False  # what was waiting has been read
        if conn.session is None and self._pending.pop(conn, 0) is None:
            self._pending[conn] = None
            mine = self._pending_by_peer[conn.peer]
            del mine[conn]
            mine[conn] = None

    def admit(self, conn: Conn, session: Session) -> None:
        """Make a pending connection whose hello was accepted a session; raises
        UnavailableError (and counts the refusal) when a session limit is reached."""
        if conn.closing:
            raise UnavailableError("the connection was closed before its hello was answered")
        reason = None
        if len(self._sessions) >= self._limits.max_sessions:
            reason, error = (
                "max_sessions",
                UnavailableError(
                    f"too many sessions (limit {self._limits.max_sessions}); try again later"
                ),
            )
        elif self._sessions_by_peer[conn.peer] >= self._limits.control_max_sessions_per_peer:
            reason, error = (
                "per_peer_limit",
                UnavailableError(
                    f"too many sessions from this peer (limit "
                    f"{self._limits.control_max_sessions_per_peer})"
                ),
            )
        if reason is not None:
            self._count(conn, reason)
            raise error
        self._forget_pending(conn)
        conn.session = session
        self._sessions[conn] = None
        self._sessions_by_peer[conn.peer] += 1
        conn.touch()

    def release(self, conn: Conn) -> None:
        """The connection ended (any reason): forget it. Idempotent."""
        self._forget_pending(conn)
        if self._sessions.pop(conn, 0) is None:
            self._sessions_by_peer[conn.peer] -= 1
            if not self._sessions_by_peer[conn.peer]:
                del self._sessions_by_peer[conn.peer]

    def refused(self, conn: Conn, reason: str) -> None:
        """Count a connection the control server ends itself (a bad frame or hello)."""
        self._count(conn, reason)

    def close(self, conn: Conn, reason: str, error: KVFabricError | None = None) -> None:
        """Close ``conn`` now, telling the client why (best effort: never waits for a client
        that does not read), and count it. The connection's reader then sees EOF."""
        if conn.closing:
            return
        conn.closing = True
        self._forget_pending(conn)
        writer = conn.writer
        if error is not None and not writer.is_closing():
            with contextlib.suppress(Exception):
                writer.write(encode_frame(error_reply(0, error)))
        writer.close()
        self._count(conn, reason)

    def close_all(self) -> None:
        """Shutting down: close every connection, without counting them as refused."""
        for conn in [*self._pending, *self._sessions]:
            conn.closing = True
            self._forget_pending(conn)
            conn.writer.close()

    def sweep_interval(self) -> float:
        idle = self._limits.control_idle_timeout_s
        return LOG_EVERY_S if not idle else min(LOG_EVERY_S, max(0.05, idle / 4))

    def sweep(self) -> None:
        """Close idle sessions; write the summary of closes not logged yet."""
        idle = self._limits.control_idle_timeout_s
        if idle:
            stale = time.monotonic() - idle
            for conn in list(self._sessions):
                session = conn.session
                if (
                    conn.last_active < stale
                    and not conn.in_flight
                    and session is not None
                    and not session.lease_count
                ):
                    self.close(
                        conn,
                        "idle",
                        UnavailableError(f"session closed after {idle:g} s without requests"),
                    )
        self._log()

    def _push_out(self, pool: dict[Conn, None], reason: str, error: KVFabricError) -> None:
        """Close the connection of ``pool`` silent the longest, passing over those whose first
        frame is waiting to be read (the next read settles them); none if all are."""
        limit = self._limits.control_hello_max_bytes
        for conn in pool:
            if conn.frame_waiting:
                continue
            if (conn.reader is not None and conn.reader.unread) or _frame_waiting(conn, limit):
                conn.frame_waiting = True  # looked at once: not again
                continue
            self.close(conn, reason, error)
            return

    def _hello_expired(self, conn: Conn) -> None:
        if conn in self._pending:
            self.close(
                conn,
                "hello_timeout",
                DeadlineExceededError(
                    f"no hello within {self._limits.control_hello_timeout_s:g} s of connecting"
                ),
            )

    def _forget_pending(self, conn: Conn) -> None:
        if conn.deadline is not None:
            conn.deadline.cancel()
            conn.deadline = None
        if self._pending.pop(conn, 0) is None:
            mine = self._pending_by_peer[conn.peer]
            del mine[conn]
            if not mine:
                del self._pending_by_peer[conn.peer]
            self._metrics.control_pending(len(self._pending))

    def _count(self, conn: Conn, reason: str) -> None:
        self._count_listener(conn.listener, reason)

    def _count_listener(self, listener: str, reason: str) -> None:
        self._metrics.control_connection_closed(listener, reason)
        self._unlogged[(listener, reason)] += 1
        self._log()

    def _log(self) -> None:
        now = time.monotonic()
        if not self._unlogged or now - self._last_log < LOG_EVERY_S:
            return
        self._last_log = now
        summary = ", ".join(
            f"{listener}/{reason}={n}" for (listener, reason), n in sorted(self._unlogged.items())
        )
        self._unlogged.clear()
        log.warning(
            "control plane refused or closed connections (since the last such line): "
            "%s; %d pending, %d sessions",
            summary,
            len(self._pending),
            len(self._sessions),
        )


def _frame_waiting(conn: Conn, limit: int) -> bool:
    """Whether the kernel holds, unread, a whole first frame of ``conn`` (or a header over
    ``limit``, refused at the first read): a non-blocking ``MSG_PEEK`` of the socket. Never on
    TLS (its socket holds records, not frames)."""
    writer = conn.writer
    sock = writer.get_extra_info("socket")
    if sock is None or writer.get_extra_info("ssl_object") is not None:
        return False
    try:
        raw = socket.socket(sock.family, sock.type, sock.proto, sock.fileno())
    except (OSError, ValueError):
        return False
    try:  # a view of the transport's descriptor, detached below: the transport keeps it
        data = _peek(raw)
    finally:
        raw.detach()
    if data is None or len(data) < _FRAME_LEN.size:
        return False
    length = int(_FRAME_LEN.unpack_from(data)[0])
    return length > limit or _FRAME_LEN.size + length <= len(data)


def _peek(sock: socket.socket) -> bytes | None:
    """What the kernel holds unread on ``sock`` (up to PEEK_BYTES), without taking it."""
    try:
        return sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return None


def peer_of(writer: asyncio.StreamWriter, local: bool) -> str:
    """The peer a connection counts against: its uid (Unix socket) or source address."""
    if local:
        return peer_of_socket(writer.get_extra_info("socket"))
    peername = writer.get_extra_info("peername")
    return f"ip:{peername[0]}" if isinstance(peername, tuple) and peername else "ip:?"


def peer_of_socket(sock: Any) -> str:
    """A Unix connection's peer: the uid that connected (``SO_PEERCRED``)."""
    try:
        _, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except (OSError, AttributeError, struct.error):
        return "uid:?"  # not Linux: every local client is one peer
    return f"uid:{uid}"
