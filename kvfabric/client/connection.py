"""A blocking control connection to the node daemon.

Connect (Unix socket, or TCP for remote tooling, over TLS when given a TLS option: see
:mod:`kvfabric.client.tls`), ``hello`` (with the token when one is configured), receive the
arena descriptors (SCM_RIGHTS) and map them; then one request at a time with a deadline
each. A deadline that passes mid-reply leaves the stream out of sync,
so the connection is closed and must be re-established (the client does that).

Connecting is retried with backoff within the connection's deadline when the daemon is
there but busy: a full accept queue (``EAGAIN`` on the Unix socket), a connection the daemon
closed before answering hello (a flood pushed it out) or a hello refused as unavailable (at
``max_sessions``). A refused connection (``ECONNREFUSED``: nothing listening) is retried for
:data:`REFUSED_RETRY_S` only, and a missing socket file not at all, so that a client of a
daemon that is down fails fast. Every failure is a :class:`~kvfabric.errors.KVFabricError`
(:class:`~kvfabric.errors.UnavailableError`, :class:`~kvfabric.errors.DeadlineExceededError`,
...): no raw ``OSError`` or ``ValueError`` escapes.
"""

from __future__ import annotations

import errno
import itertools
import logging
import select
import socket
import ssl
import threading
import time
from array import array
from collections.abc import Iterable
from typing import Any, NoReturn

from kvfabric.client import tls as client_tls
from kvfabric.client.arenas import ArenaSet
from kvfabric.client.retry import Backoff, ExponentialBackoff
from kvfabric.client.tls import TLSOption
from kvfabric.errors import (
    DeadlineExceededError,
    KVFabricError,
    ProtocolError,
    UnavailableError,
    error_for_kind,
)
from kvfabric.protocol.frames import FrameDecoder, encode_frame
from kvfabric.protocol.messages import Op, request

log = logging.getLogger(__name__)

MAX_FDS = 253  # SCM_RIGHTS limit: an admin session gets every tenant's arenas
CLIENT_NAME = "kvfabric-python"
REFUSED_RETRY_S = 1.0  # a listener that refuses for this long is down, not busy
_BUSY = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR})

Address = str | tuple[str, int]


def open_socket(address: Address, timeout: float, backoff: Backoff | None = None) -> socket.socket:
    """A connected socket, within ``timeout`` seconds; busy listeners are retried."""
    now = time.monotonic()
    deadline, refused_until = now + timeout, now + min(timeout, REFUSED_RETRY_S)
    backoff = backoff or ExponentialBackoff()
    attempt = 0
    while True:
        try:
            return _connect(address, deadline)
        except OSError as exc:
            now = time.monotonic()
            busy = exc.errno in _BUSY or (exc.errno == errno.ECONNREFUSED and now < refused_until)
            if not busy or now >= deadline:
                raise UnavailableError(
                    f"cannot reach the kvfabric daemon at {address}: {exc}"
                ) from None
        time.sleep(min(backoff.delay(attempt), max(0.0, deadline - now)))
        attempt += 1


def _connect(address: Address, deadline: float) -> socket.socket:
    timeout = max(deadline - time.monotonic(), 0.001)
    if isinstance(address, tuple):
        sock = socket.create_connection(address, timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)  # a full accept queue: EAGAIN at once, not a wait
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def handshake(
    sock: socket.socket,
    token: str | None,
    deadline: float,
    decoder: FrameDecoder,
    client: str | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """Send hello (``client``: the engine or tool this session serves, a metrics label),
    read its reply and any passed descriptors. Socket errors come out typed."""
    try:
        return _handshake(sock, token, deadline, decoder, client)
    except KVFabricError:
        raise
    except TimeoutError:
        raise DeadlineExceededError("hello: no reply from the daemon before the deadline") from None
    except ssl.SSLError as exc:  # TLS 1.3: a refused client certificate shows up here
        raise client_tls.failure(exc, "the daemon") from None
    except OSError as exc:
        raise UnavailableError(f"lost the daemon during hello: {exc}") from None


def _handshake(
    sock: socket.socket,
    token: str | None,
    deadline: float,
    decoder: FrameDecoder,
    client: str | None,
) -> tuple[dict[str, Any], list[int]]:
    sock.settimeout(_remaining(deadline, "hello"))
    sock.sendall(
        encode_frame(request(0, Op.HELLO, {"token": token, "client": client or CLIENT_NAME}))
    )
    fds: list[int] = []
    local = sock.family == socket.AF_UNIX
    while True:
        sock.settimeout(_remaining(deadline, "hello"))
        if local:
            data, ancdata, _flags, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array("i", cdata[: len(cdata) - len(cdata) % 4]))
        else:
            data = sock.recv(1 << 16)
        if not data:
            raise UnavailableError("the daemon closed the connection during hello")
        for message in decoder.feed(data):
            return result_of(message), fds


def open_session(
    address: Address,
    token: str | None,
    deadline: float,
    backoff: Backoff | None = None,
    client: str | None = None,
    tls: TLSOption = None,
) -> tuple[socket.socket, FrameDecoder, dict[str, Any], list[int]]:
    """Connect (over TLS to a TCP ``address`` when ``tls`` is given) and hello before
    ``deadline`` (monotonic): the socket, its decoder, the hello reply and the passed
    descriptors. A daemon that is reachable but busy (it closed the connection before
    answering, or answered ``unavailable``: at ``max_sessions``) is asked again with backoff;
    one that is not reachable fails at once (see :func:`open_socket`), and so does a TLS
    handshake that fails on certificates (AuthError)."""
    backoff = backoff or ExponentialBackoff()
    attempt = 0
    busy: UnavailableError | None = None
    while True:
        if busy is not None and time.monotonic() >= deadline:
            raise busy  # what the daemon last said, not a bare deadline
        sock = open_socket(address, _remaining(deadline, "connect"), backoff)
        decoder = FrameDecoder()
        try:
            if tls is not None and isinstance(address, tuple):
                sock = client_tls.wrap(sock, tls, address[0], deadline)
            hello, fds = handshake(sock, token, deadline, decoder, client)
            return sock, decoder, hello, fds
        except UnavailableError as exc:
            sock.close()
            pause = backoff.delay(attempt)
            if time.monotonic() + pause >= deadline:
                raise
            busy = exc
            time.sleep(pause)
            attempt += 1
        except BaseException:
            sock.close()
            raise


def map_arenas(hello: dict[str, Any], fds: list[int]) -> ArenaSet:
    """The arenas the hello announced, mapped from ``fds`` (typed errors only)."""
    try:
        return ArenaSet(hello.get("arenas", []), fds)
    except (OSError, ValueError) as exc:
        if isinstance(exc, KVFabricError):
            raise
        raise UnavailableError(f"cannot map the daemon's shared memory: {exc}") from None


class PendingReply:
    """A request sent on a :class:`Connection` whose reply has not been asked for yet."""

    def __init__(self, connection: Connection, request_id: int, op: Op, deadline: float) -> None:
        self._connection, self.request_id, self.op, self.deadline = (
            connection,
            request_id,
            op,
            deadline,
        )

    def result(self) -> Any:
        """The request's result (or its error), waiting until the reply's deadline."""
        return result_of(self._connection._reply_for(self))

    def discard(self) -> None:
        """Nobody will ask for this reply: it is dropped when read (a failure is logged)."""
        self._connection._discard(self)


class Connection:
    """One authenticated session; thread-safe (requests are written whole, one at a time,
    and each reply reaches whoever waits on it)."""

    def __init__(
        self,
        address: Address,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        client: str | None = None,
        backoff: Backoff | None = None,
        tls: TLSOption = None,
    ) -> None:
        """Connect and hello within ``timeout`` seconds (retrying a busy daemon); ``tls``:
        see :mod:`kvfabric.client.tls`."""
        self.address = address
        self.timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock, self._decoder, self.hello, fds = open_session(
            address, token, time.monotonic() + timeout, backoff, client, tls
        )
        try:
            self.arenas = map_arenas(self.hello, fds)
        except BaseException:
            self._sock.close()
            raise
        self._closed = False
        # replies read while waiting for another one, for requests still waited on
        self._replies: dict[int, dict[str, Any]] = {}
        self._waited: set[int] = set()
        self._unread = 0  # requests sent whose reply has not been read yet
        self._poll = select.poll()  # tells a session the daemon ended while it was idle
        self._poll.register(self._sock, select.POLLIN)

    @property
    def closed(self) -> bool:
        """Whether this session is over: closed here, or ended by the daemon while no
        request was in flight (it closes idle sessions, and sends nothing unasked otherwise:
        anything readable then is its hang-up or a stream-level error). Callers holding a
        connection check this before a request and open a new one, instead of losing the
        request on a session that is already gone."""
        if self._closed:
            return True
        if not self._lock.acquire(blocking=False):
            return False  # a request is in flight: it reports its own errors
        try:
            if not self._closed and self._poll.poll(0):
                if self._unread:
                    self._read_ready()  # replies of requests nobody waited on yet
                elif client_tls.hung_up(self._sock):
                    self._close_locked()
            return self._closed
        finally:
            self._lock.release()

    def call(self, op: Op, args: dict[str, Any], timeout: float | None = None) -> Any:
        return self.send(op, args, timeout).result()

    def send(self, op: Op, args: dict[str, Any], timeout: float | None = None) -> PendingReply:
        """Write one request without waiting for its reply; ``timeout`` bounds the send and
        the wait for the reply (default: the connection's)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            if self._closed:
                raise UnavailableError("connection is closed")
            request_id = next(self._ids)
            frame = encode_frame(request(request_id, op, args))  # too big: nothing sent
            self._waited.add(request_id)
            try:
                self._sock.settimeout(_remaining(deadline, op.value))
                self._sock.sendall(frame)
            except (OSError, ProtocolError) as exc:
                self._waited.discard(request_id)
                self._fail(exc, op.value)
            self._unread += 1
        return PendingReply(self, request_id, op, deadline)

    def _reply_for(self, pending: PendingReply) -> dict[str, Any]:
        with self._lock:
            try:
                while (reply := self._replies.pop(pending.request_id, None)) is None:
                    if self._closed:
                        raise UnavailableError("connection is closed")
                    self._read_replies(pending.deadline, pending.op.value)
                return reply
            except (OSError, ProtocolError) as exc:
                self._fail(exc, pending.op.value)
            finally:
                self._waited.discard(pending.request_id)

    def _discard(self, pending: PendingReply) -> None:
        with self._lock:
            self._waited.discard(pending.request_id)
            reply = self._replies.pop(pending.request_id, None)
        if reply is not None:
            _log_dropped(reply, pending.op.value)

    def _read_ready(self) -> None:
        """Read, without waiting, what the daemon has sent (the lock held)."""
        try:
            self._sock.settimeout(0)
            data = self._sock.recv(1 << 16)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            self._close_locked()
            return
        if not data:
            self._close_locked()
            return
        try:
            self._take(self._decoder.feed(data), "a poll")
        except KVFabricError:
            self._close_locked()

    def _read_replies(self, deadline: float, what: str) -> None:
        """Read what the daemon sent: keep the replies someone waits for."""
        self._take(self._read(deadline, what), what)

    def _take(self, messages: Iterable[dict[str, Any]], what: str) -> None:
        for message in messages:
            self._unread = max(0, self._unread - 1)
            request_id = message.get("id")
            if request_id == 0 and message.get("ok") is False:
                result_of(message)  # the daemon is rejecting the whole stream: raises
            if request_id in self._waited:
                self._replies[request_id] = message
            else:
                _log_dropped(message, what)

    def _fail(self, exc: BaseException, what: str) -> NoReturn:
        self._close_locked()  # the stream is out of sync or gone
        if isinstance(exc, KVFabricError):
            raise exc
        raise UnavailableError(f"lost the daemon during {what}: {exc}") from None

    def _read(self, deadline: float, what: str) -> list[dict[str, Any]]:
        self._sock.settimeout(_remaining(deadline, what))
        try:
            data = self._sock.recv(1 << 16)
        except TimeoutError:
            raise DeadlineExceededError(f"{what}: no reply before the deadline") from None
        if not data:
            raise UnavailableError("the daemon closed the connection")
        return list(self._decoder.feed(data))

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
            self.arenas.close()


def result_of(message: dict[str, Any]) -> Any:
    if message.get("ok") is True:
        return message.get("result")
    error = message.get("error")
    if not isinstance(error, dict):
        raise ProtocolError("malformed reply from the daemon")
    raise error_for_kind(str(error.get("kind")), str(error.get("message")))


def _log_dropped(message: dict[str, Any], what: str) -> None:
    if message.get("ok") is False:
        log.debug("a discarded request failed (read during %s): %s", what, message.get("error"))


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"{what}: deadline exceeded")
    return left
