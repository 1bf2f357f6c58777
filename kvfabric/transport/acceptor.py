"""Bounded accept + handshake for the socket transport: one thread, no thread per stranger.

Contract: :class:`Acceptor` owns a listening socket. One thread accepts connections and runs
every handshake on a selector, non-blocking; only a connection whose handshake succeeded is
handed on (``on_ready``), which is where the transport gives it a serving thread. So a flood
of connections that never handshake costs file descriptors and a little memory, never
threads, and every bound below holds:

* a handshake must finish within ``handshake_timeout_s`` of the accept, or it is closed;
* at most ``max_handshakes`` handshakes are in progress at once, and ``max_per_ip`` from one
  address; beyond that the oldest one (of that address, or of all) is closed to make room, so
  a flood cannot lock out a peer that completes its handshake promptly;
* at most ``max_connections`` authenticated connections (``connections()``); beyond that a
  handshake is answered ``{ok: false, kind: "unavailable"}`` and closed;
* a handshake frame larger than :data:`MAX_HANDSHAKE_FRAME` is refused unread.

With an ``ssl_context`` (mutual TLS on the peer plane) every accepted socket first runs its
TLS handshake on the same selector, non-blocking (``do_handshake`` until it stops asking to
read or write), and is greeted only once TLS is up; the deadline, the caps and the eviction
above count from the accept, so they cover both handshakes. A TLS failure (a certificate
from another CA, no certificate, plain bytes) counts as ``failed`` and is closed at once.

The accept loop survives errors: out of file descriptors (EMFILE/ENFILE) or memory, it
sheds its oldest pending handshake, pauses accepting for :data:`PAUSE_S` and carries on;
anything unexpected in one iteration is logged and the loop goes on. If the thread ever ends
other than by :meth:`close` (say, the listener was shut down under it), :attr:`alive` turns
False and :attr:`failure` says why (the daemon's ``/readyz`` reports it).
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfabric.errors import KVFabricError, ProtocolError
from kvfabric.protocol.frames import HEADER, decode_body, encode_frame, frame_length

log = logging.getLogger(__name__)

MAX_HANDSHAKE_FRAME = 4096
PAUSE_S = 0.1  # accepting stops this long after the process ran out of descriptors / memory
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_LOG_EVERY_S = 10.0

# greet() -> (first frame to send, state); finish(state, message) -> (reply frame, peer name),
# or a KVFabricError to refuse; on_ready(sock, name) -> False to refuse (the socket is closed).
Greet = Callable[[], tuple[bytes, Any]]
Finish = Callable[[Any, dict[str, Any]], tuple[bytes, str]]
OnReady = Callable[[socket.socket, str], bool]


@dataclass(frozen=True)
class AcceptLimits:
    handshake_timeout_s: float = 5.0
    max_handshakes: int = 256
    max_per_ip: int = 32
    max_connections: int = 512

    def __post_init__(self) -> None:
        if (
            self.handshake_timeout_s <= 0
            or min(self.max_handshakes, self.max_per_ip, self.max_connections) <= 0
        ):
            raise ValueError("accept limits must be positive")


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    ip: str
    deadline: float
    state: Any
    buffer: bytearray = field(default_factory=bytearray)
    greeted: bool = True  # False: the TLS handshake is still running, nothing sent yet


@dataclass
class AcceptStats:
    accepted: int = 0
    refused: int = 0  # over the connection cap, at accept or at the end of the handshake
    evicted: int = 0  # pending handshakes closed to make room for newer ones
    timed_out: int = 0
    failed: int = 0  # bad frame or bad credentials (a failed TLS handshake included)
    accept_errors: int = 0


class _ListenerGone(Exception):
    """The listening socket was closed or shut down by someone other than close()."""


class Acceptor:
    def __init__(
        self,
        listener: socket.socket,
        name: str,
        *,
        greet: Greet,
        finish: Finish,
        on_ready: OnReady,
        connections: Callable[[], int],
        limits: AcceptLimits = AcceptLimits(),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._listener = listener
        self._ssl = ssl_context
        self._greet, self._finish, self._on_ready = greet, finish, on_ready
        self._connections = connections
        self.limits = limits
        self.stats = AcceptStats()
        self.failure: str | None = None
        self._pending: dict[socket.socket, _Pending] = {}
        self._per_ip: collections.Counter[str] = collections.Counter()
        self._stopping = False
        self._paused_until = 0.0
        self._last_log = 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kvf-transport-{name}-accept"
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Accepting (or shut down on purpose): False only when the loop died."""
        return self.failure is None

    @property
    def pending(self) -> int:
        """Handshakes in progress."""
        return len(self._pending)

    def close(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)
        self._wake_w.close()

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except _ListenerGone:
                    raise
                except Exception:  # one bad iteration must not end accepting for good
                    log.exception("peer transport: accept loop error (continuing)")
                    time.sleep(PAUSE_S)
        except _ListenerGone as exc:
            self.failure = f"accept loop ended: {exc}"
            log.critical("peer transport: %s", self.failure)
        except BaseException as exc:
            self.failure = f"accept loop died: {type(exc).__name__}: {exc}"
            log.critical("peer transport: %s", self.failure)
            raise
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._wake_r.close()
            if not self._stopping and self.failure is None:
                self.failure = "accept loop ended"

    def _iterate(self) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        deadlines = [p.deadline for p in self._pending.values()]
        if self._paused_until:
            deadlines.append(self._paused_until)
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._listener:
                self._accept_some()
            elif key.fileobj is self._wake_r:
                return
            else:
                pending = self._pending.get(key.fileobj)  # type: ignore[call-overload]
                if pending is not None and (pending.greeted or self._secure(pending)):
                    self._advance(pending)
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self.stats.timed_out += 1
            self._drop(pending)

    def _accept_some(self) -> None:
        for _ in range(64):  # then let pending handshakes progress
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._stopping:
                    return
                if exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    raise _ListenerGone(f"listener unusable: {exc}") from None
                self.stats.accept_errors += 1
                if exc.errno in _RESOURCE_ERRNOS:
                    self._shed_and_pause(exc)
                    return
                self._rate_limited_warning("accept failed: %s", exc)  # e.g. ECONNABORTED
                continue
            self._admit(sock, str(address[0]) if isinstance(address, tuple) else "")

    def _admit(self, sock: socket.socket, ip: str) -> None:
        limits = self.limits
        if self._connections() >= limits.max_connections:
            self.stats.refused += 1
            sock.close()
            return
        if self._per_ip[ip] >= limits.max_per_ip:  # this address's oldest makes room
            self._evict(next(p for p in self._pending.values() if p.ip == ip))
        if len(self._pending) >= limits.max_handshakes:  # the oldest of all makes room
            self._evict(next(iter(self._pending.values())))
        try:
            sock.setblocking(False)
            if self._ssl is not None:  # the client speaks first (ClientHello); greet after
                sock = self._ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                state, greeted = None, False
            else:
                hello, state = self._greet()
                if sock.send(hello) != len(hello):  # a fresh socket takes a few dozen bytes
                    raise ConnectionError("short send of the greeting")
                greeted = True
        except OSError:
            sock.close()
            return
        self.stats.accepted += 1
        pending = _Pending(
            sock, ip, time.monotonic() + limits.handshake_timeout_s, state, greeted=greeted
        )
        self._pending[sock] = pending
        self._per_ip[ip] += 1
        self._selector.register(sock, selectors.EVENT_READ)

    def _secure(self, pending: _Pending) -> bool:
        """Advance the TLS handshake; True once it is done and the greeting is sent."""
        sock = pending.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE)
            return False
        except ssl.SSLError as exc:  # foreign or missing certificate, not TLS at all
            self.stats.failed += 1
            log.debug("peer transport: TLS handshake from %s failed: %s", pending.ip, exc)
            self._drop(pending)
            return False
        except OSError:
            self._drop(pending)
            return False
        self._selector.modify(sock, selectors.EVENT_READ)
        try:
            hello, pending.state = self._greet()
            if sock.send(hello) != len(hello):
                raise ConnectionError("short send of the greeting")
        except OSError:  # SSLWantWriteError included: a fresh connection takes a few bytes
            self._drop(pending)
            return False
        pending.greeted = True
        return True  # the client's answer may already sit decrypted in the TLS buffer

    def _advance(self, pending: _Pending) -> None:
        """Read what arrived; finish the handshake once the whole frame is in."""
        while True:  # TLS: a record read may leave more decrypted in the buffer, unsignalled
            try:
                data = pending.sock.recv(MAX_HANDSHAKE_FRAME + HEADER - len(pending.buffer))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:
                self._drop(pending)
                return
            if not data:
                self._drop(pending)
                return
            pending.buffer += data
            if len(pending.buffer) < HEADER:
                continue
            if self._complete(pending):
                return

    def _complete(self, pending: _Pending) -> bool:
        """Finish the handshake if the whole frame is in; False: wait for more bytes."""
        try:
            length = frame_length(bytes(pending.buffer[:HEADER]))
            if length > MAX_HANDSHAKE_FRAME:
                raise ProtocolError(
                    f"handshake frame of {length} bytes (limit {MAX_HANDSHAKE_FRAME})"
                )
            if len(pending.buffer) < HEADER + length:
                return False
            message = decode_body(bytes(pending.buffer[HEADER : HEADER + length]))
            if self._connections() >= self.limits.max_connections:
                self.stats.refused += 1
                reply = encode_frame(
                    {"ok": False, "kind": "unavailable", "message": "too many peer connections"}
                )
                name: str | None = None
            else:
                reply, name = self._finish(pending.state, message)
        except KVFabricError as exc:
            self.stats.failed += 1
            reply, name = encode_frame({"ok": False, "kind": exc.kind, "message": str(exc)}), None
        self._release(pending)
        sock = pending.sock
        try:
            sock.send(reply)  # small; a peer that cannot take it is not worth waiting for
        except OSError:
            name = None
        if name is None:
            sock.close()
            return True
        sock.setblocking(True)
        if not self._on_ready(sock, name):
            sock.close()
        return True

    def _release(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock, None)
        with_ip = self._per_ip[pending.ip] - 1
        if with_ip > 0:
            self._per_ip[pending.ip] = with_ip
        else:
            self._per_ip.pop(pending.ip, None)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def _evict(self, pending: _Pending) -> None:
        self.stats.evicted += 1
        self._drop(pending)

    def _drop(self, pending: _Pending) -> None:
        self._release(pending)
        pending.sock.close()

    def _shed_and_pause(self, exc: OSError) -> None:
        """Out of descriptors or memory: free the oldest handshake's descriptor and stop
        accepting for a moment, instead of spinning on a listener that stays readable."""
        if self._pending:
            self._evict(next(iter(self._pending.values())))  # the oldest
        if not self._paused_until:
            self._selector.unregister(self._listener)
            self._paused_until = time.monotonic() + PAUSE_S
        self._rate_limited_warning("accept failed (%s); pausing %.1f s", exc, PAUSE_S)

    def _rate_limited_warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning(
                "peer transport: " + message + " (%d accept errors so far)",
                *args,
                self.stats.accept_errors,
            )
