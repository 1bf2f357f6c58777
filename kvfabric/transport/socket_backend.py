"""Socket backend: framed TCP requests served out of registered regions.

Each transport runs one accept thread, which also runs every inbound handshake on a selector
with a deadline and caps (:mod:`kvfabric.transport.acceptor`), and one thread per
*authenticated* inbound connection (at most ``limits.max_connections``). Wire protocol
(control messages are :mod:`kvfabric.protocol.frames` msgpack frames, payload bytes are raw):

* handshake: server ``{v, name, nonce}`` -> client ``{v, name, nonce, mac}`` -> server
  ``{ok, mac}``; with a cluster secret both MACs are checked (mutual HMAC challenge-response;
  an empty or absent MAC is refused), a failure is answered ``{ok: false, kind:
  "unauthorized"}`` and the connection is closed. Without a secret anyone who reaches the port
  can read and write the registered regions: the daemon refuses a non-loopback bind then
  (:func:`kvfabric.config.check_binds`).
* read: ``{op: "read", pieces: [[region, offset, length], ...]}`` -> ``{ok}`` + the bytes of
  every piece in order, sent straight from the region (memoryview slices, no copy).
* write: ``{op: "write", pieces: [...]}`` -> ``{ok}`` (bounds accepted) -> the client streams
  the bytes, which the server ``recv_into``s the region in place -> ``{ok}``.
* notify: ``{op: "notify", message}`` -> ``{ok}``.

Optional mutual TLS (``server_ssl`` + ``client_ssl``; the daemon's ``security.tls_planes``
with ``peer``): every connection is TLS from its first byte, the handshake above runs inside
it. The acceptor runs the TLS handshake on its selector within the same deadline and caps
(:mod:`kvfabric.transport.acceptor`); the server requires a client certificate signed by its
client CA, the client checks the server's chain and that it names the descriptor's host.
``client_ssl`` is called once per new connection (the daemon's is reloaded with its
certificate). The descriptor says whether the endpoint speaks TLS, and a node never falls
back to plain TCP: a TLS node refuses a plain peer and vice versa (UnavailableError naming
the mismatch). A TLS failure (a certificate from another CA, none, a name that does not
match) is an AuthError. The HMAC handshake still runs inside TLS: the cluster secret and
mTLS are independent checks.

Every piece is bounds-checked (known region, ``0 <= offset``, ``offset + length <= size``)
before a byte moves; a bad request gets ``{ok: false, kind, message}`` and the connection
keeps serving. Client sockets take their timeout from the caller's deadline before every
``send``/``recv``, so a frozen peer yields ``DeadlineExceededError``; a connection that saw an
error is closed, never reused, and idle pooled connections the peer closed are skipped. The
server drops a connection stalled mid-request for ``io_timeout`` or idle for ``idle_timeout``,
so a dead or frozen consumer holds its thread for a bounded time.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvfabric.errors import (
    AuthError,
    DeadlineExceededError,
    KVFabricError,
    ProtocolError,
    UnavailableError,
    error_for_kind,
)
from kvfabric.protocol.frames import HEADER, decode_body, encode_frame, frame_length
from kvfabric.transport import auth
from kvfabric.transport.acceptor import AcceptLimits, Acceptor
from kvfabric.transport.base import (
    Peer,
    PeerDescriptor,
    ReadPiece,
    Transport,
    WritePiece,
    byte_view,
    end_time,
    remaining,
)

log = logging.getLogger(__name__)

WIRE_VERSION = 1
MAX_NOTIFICATIONS = 65536  # queued, unpolled; the oldest are dropped beyond this
_CLIENT_PURPOSE = "kvfabric-socket-client"
_SERVER_PURPOSE = "kvfabric-socket-server"


class _Stalled(Exception):
    """Server side: a peer stopped sending in the middle of a request."""


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    header = bytearray(HEADER)
    _recv_exact(sock, memoryview(header))
    body = bytearray(frame_length(bytes(header)))
    _recv_exact(sock, memoryview(body))
    return decode_body(bytes(body))


def _parse_pieces(raw: object) -> list[tuple[int, int, int]]:
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("pieces must be a non-empty list")
    pieces = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
        ):
            raise ProtocolError(f"a piece must be [region, offset, length], got {item!r}")
        pieces.append((item[0], item[1], item[2]))
    return pieces


class SocketPeer(Peer):
    """A peer reached over TCP: a pool of authenticated connections (one per concurrent op)."""

    def __init__(self, descriptor: PeerDescriptor) -> None:
        super().__init__(descriptor)
        self.idle: list[socket.socket] = []
        self.lock = threading.Lock()


class SocketTransport(Transport):
    """TCP transport; see the module docstring for the protocol and failure behaviour."""

    backend = "socket"

    def __init__(
        self,
        name: str,
        *,
        secret: bytes | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout: float = 30.0,
        idle_timeout: float = 300.0,
        limits: AcceptLimits = AcceptLimits(),
        server_ssl: ssl.SSLContext | None = None,
        client_ssl: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        """Listen on ``host:port`` (0: any free port); peers are told ``advertise_host``
        (default: the bound address, which must then be reachable, i.e. not a wildcard).
        ``io_timeout`` bounds how long a peer may stall in the middle of a request,
        ``idle_timeout`` how long an inbound connection may wait for its next request;
        ``limits`` bound handshakes and connections (see :mod:`~kvfabric.transport.acceptor`);
        ``server_ssl`` (requiring client certificates) and ``client_ssl`` (a callable giving
        the context for each new outbound connection), both or neither: mutual TLS."""
        if (server_ssl is None) != (client_ssl is None):
            raise ValueError("peer TLS needs both server_ssl and client_ssl")
        super().__init__(name, secret=secret)
        self._client_ssl = client_ssl
        self._io_timeout = io_timeout
        self._idle_timeout = idle_timeout
        self._notifications: collections.deque[tuple[str, bytes]] = collections.deque(
            maxlen=MAX_NOTIFICATIONS
        )
        self._inbound: set[socket.socket] = set()
        self._peers: dict[str, SocketPeer] = {}
        self._listener = socket.create_server((host, port), backlog=1024)
        bound_host, self._port = self._listener.getsockname()[:2]
        self._host = advertise_host or bound_host
        if self._host in ("0.0.0.0", "::"):
            self._listener.close()
            raise ValueError("listening on a wildcard address needs an advertise_host")
        self._acceptor = Acceptor(
            self._listener,
            name,
            greet=self._greet,
            finish=self._finish_handshake,
            on_ready=self._start_serving,
            connections=lambda: self.inbound_connections,
            limits=limits,
            ssl_context=server_ssl,
        )

    # -- client side -------------------------------------------------------------------------
    def descriptor(self) -> bytes:
        return PeerDescriptor(
            self.backend,
            self.name,
            self.region_infos(),
            host=self._host,
            port=self._port,
            tls=self.tls,
        ).encode(self._secret)

    @property
    def tls(self) -> bool:
        """Whether this transport speaks (mutual) TLS, both ways."""
        return self._client_ssl is not None

    def connect(self, peer_descriptor: bytes, deadline: float) -> SocketPeer:
        self._check_open()
        peer = SocketPeer(self._decode_descriptor(peer_descriptor))
        if peer.descriptor.tls != self.tls:  # never a silent fall back to plain TCP
            raise UnavailableError(
                f"peer {peer.name!r} {'speaks' if peer.descriptor.tls else 'does not speak'} "
                f"TLS on its transport and this node {'does' if self.tls else 'does not'}: "
                "security.tls_planes (peer) must be the same on every node"
            )
        # One connection now, so a wrong secret or a dead peer surfaces here, not mid-transfer.
        sock = self._open(peer, end_time(deadline))
        peer.idle.append(sock)
        with self._lock:
            old = self._peers.get(peer.name)
            self._peers[peer.name] = peer
        if old is not None:  # re-connect: the old handle's pooled connections go
            self._drop_idle(old)
        return peer

    def read(self, peer: Peer, pieces: Sequence[ReadPiece], deadline: float) -> None:
        views = [byte_view(p.local, writable=True) for p in pieces]
        for view in views:
            self.local_region_of(view)
        request = {
            "op": "read",
            "pieces": [[p.remote_region, p.remote_offset, len(v)] for p, v in zip(pieces, views)],
        }

        def exchange(sock: socket.socket, end: float) -> None:
            self._call(sock, request, end)
            for view in views:
                got = 0
                while got < len(view):
                    sock.settimeout(remaining(end, "read"))
                    n = sock.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("peer closed the connection mid-read")
                    got += n

        self._with_connection(peer, exchange, deadline, "read")

    def write(self, peer: Peer, pieces: Sequence[WritePiece], deadline: float) -> None:
        views = [byte_view(p.local, writable=False) for p in pieces]
        for view in views:
            self.local_region_of(view)
        request = {
            "op": "write",
            "pieces": [[p.remote_region, p.remote_offset, len(v)] for p, v in zip(pieces, views)],
        }

        def exchange(sock: socket.socket, end: float) -> None:
            self._call(sock, request, end)
            for view in views:
                # sendall's timeout bounds the whole call (Python >= 3.5), not each chunk.
                sock.settimeout(remaining(end, "write"))
                sock.sendall(view)
            self._reply(sock, end)

        self._with_connection(peer, exchange, deadline, "write")

    def notify(self, peer: Peer, message: bytes, deadline: float) -> None:
        request = {"op": "notify", "message": bytes(message)}
        self._with_connection(
            peer, lambda sock, end: self._call(sock, request, end), deadline, "notify"
        )

    @property
    def inbound_connections(self) -> int:
        """Authenticated peer connections this transport currently serves (one thread each)."""
        with self._lock:
            return len(self._inbound)

    @property
    def pending_handshakes(self) -> int:
        """Inbound connections still in their handshake (no thread of their own)."""
        return self._acceptor.pending

    @property
    def serving(self) -> bool:
        """Whether inbound connections are still accepted (False: the accept loop died, see
        :attr:`failure`; a closed transport is not serving either)."""
        return not self._closed and self._acceptor.alive

    @property
    def failure(self) -> str | None:
        return self._acceptor.failure

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._notifications:
            out.append(self._notifications.popleft())
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            inbound, self._inbound = list(self._inbound), set()
        self._acceptor.close()  # closes the handshakes in progress
        # shutdown() wakes the threads blocked in recv() on these sockets.
        for sock in [self._listener, *inbound]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for peer in peers:
            self._drop_idle(peer)

    @staticmethod
    def _drop_idle(peer: SocketPeer) -> None:
        with peer.lock:
            idle, peer.idle = peer.idle, []
        for sock in idle:
            sock.close()

    def _open(self, peer: SocketPeer, end: float) -> socket.socket:
        desc = peer.descriptor
        try:
            sock = socket.create_connection(
                (desc.host, desc.port), timeout=remaining(end, "connect")
            )
        except TimeoutError:
            raise DeadlineExceededError(f"connect to {desc.name!r}: deadline passed") from None
        except OSError as exc:
            raise UnavailableError(
                f"cannot reach peer {desc.name!r} at {desc.host}:{desc.port}: {exc}"
            ) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._client_ssl is not None:
                sock = self._client_ssl().wrap_socket(
                    sock, server_hostname=desc.host, do_handshake_on_connect=False
                )
                sock.settimeout(remaining(end, "TLS handshake"))
                sock.do_handshake()
            sock.settimeout(remaining(end, "handshake"))
            hello = _recv_frame(sock)
            server_nonce = hello.get("nonce")
            if hello.get("v") != WIRE_VERSION or not isinstance(server_nonce, bytes):
                raise ProtocolError(f"bad handshake from {desc.name!r}: {hello!r}")
            nonce = auth.new_nonce()
            sock.sendall(
                encode_frame(
                    {
                        "v": WIRE_VERSION,
                        "name": self.name,
                        "nonce": nonce,
                        "mac": auth.sign(
                            self._secret, _CLIENT_PURPOSE, server_nonce, nonce, self.name.encode()
                        ),
                    }
                )
            )
            reply = self._reply(sock, end)
            auth.verify(
                self._secret,
                reply.get("mac"),
                _SERVER_PURPOSE,
                nonce,
                server_nonce,
                desc.name.encode(),
            )
            return sock
        except Exception as exc:
            sock.close()
            raise self._translate(exc, desc.name, "handshake") from None

    def _with_connection(
        self,
        peer: Peer,
        exchange: Callable[[socket.socket, float], object],
        deadline: float,
        what: str,
    ) -> None:
        if not isinstance(peer, SocketPeer):
            raise TypeError(f"not a socket peer: {peer!r}")
        self._check_open()
        end = end_time(deadline)
        sock = self._take_idle(peer)
        if sock is None:
            sock = self._open(peer, end)
        try:
            exchange(sock, end)
        except BaseException as exc:
            # A request the peer refused leaves the stream in sync; anything else may not.
            if getattr(exc, "from_peer", False):
                self._give_back(peer, sock)
                raise
            sock.close()
            raise self._translate(exc, peer.name, what) from None
        self._give_back(peer, sock)

    @staticmethod
    def _take_idle(peer: SocketPeer) -> socket.socket | None:
        """A pooled connection the peer has not closed meanwhile (e.g. on its idle timeout)."""
        while True:
            with peer.lock:
                if not peer.idle:
                    return None
                sock = peer.idle.pop()
            # Between requests the peer sends nothing: readable means EOF (or garbage).
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable or not _hung_up(sock):
                return sock
            sock.close()

    def _give_back(self, peer: SocketPeer, sock: socket.socket) -> None:
        with peer.lock:
            if self._closed:
                sock.close()
            else:
                peer.idle.append(sock)

    def _call(self, sock: socket.socket, request: dict[str, Any], end: float) -> dict[str, Any]:
        sock.settimeout(remaining(end, request["op"]))
        sock.sendall(encode_frame(request))
        return self._reply(sock, end)

    @staticmethod
    def _reply(sock: socket.socket, end: float) -> dict[str, Any]:
        sock.settimeout(remaining(end, "reply"))
        reply = _recv_frame(sock)
        if reply.get("ok") is not True:
            error = error_for_kind(
                str(reply.get("kind", "internal")),
                str(reply.get("message", "peer refused the request")),
            )
            error.from_peer = True  # type: ignore[attr-defined]
            raise error
        return reply

    @staticmethod
    def _translate(exc: BaseException, peer: str, what: str) -> BaseException:
        if isinstance(exc, KVFabricError):
            return exc
        if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
            return DeadlineExceededError(f"{what} with peer {peer!r}: deadline passed")
        if isinstance(exc, ssl.SSLCertVerificationError):
            return AuthError(
                f"TLS with peer {peer!r}: its certificate is not trusted: "
                f"{exc.verify_message or exc}"
            )
        if isinstance(exc, ssl.SSLError) and not isinstance(
            exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)
        ):
            # an alert: the peer refused our certificate (TLS 1.3 says so at the first read)
            return AuthError(f"TLS with peer {peer!r} failed: {exc.reason or exc}")
        if isinstance(exc, OSError):
            return UnavailableError(f"{what} with peer {peer!r} failed: {exc}")
        return exc

    # -- server side -------------------------------------------------------------------------
    def _greet(self) -> tuple[bytes, bytes]:
        nonce = auth.new_nonce()
        return encode_frame({"v": WIRE_VERSION, "name": self.name, "nonce": nonce}), nonce

    def _finish_handshake(self, nonce: bytes, hello: dict[str, Any]) -> tuple[bytes, str]:
        """The client's answer to our greeting -> (our reply, its name); KVFabricError
        (answered and closed by the acceptor) when it is malformed or not authentic."""
        name, client_nonce = hello.get("name"), hello.get("nonce")
        if (
            hello.get("v") != WIRE_VERSION
            or not isinstance(name, str)
            or not isinstance(client_nonce, bytes)
        ):
            raise ProtocolError("malformed handshake")
        auth.verify(
            self._secret, hello.get("mac"), _CLIENT_PURPOSE, nonce, client_nonce, name.encode()
        )
        return encode_frame(
            {
                "ok": True,
                "mac": auth.sign(
                    self._secret, _SERVER_PURPOSE, client_nonce, nonce, self.name.encode()
                ),
            }
        ), name

    def _start_serving(self, sock: socket.socket, peer_name: str) -> bool:
        """An authenticated connection gets its thread (False: refused, the caller closes)."""
        with self._lock:
            if self._closed:
                return False
            self._inbound.add(sock)
        try:
            threading.Thread(
                target=self._serve,
                args=(sock, peer_name),
                daemon=True,
                name=f"kvf-transport-{self.name}-conn",
            ).start()
        except RuntimeError as exc:  # can't start new thread: refuse this one, keep going
            log.warning("transport %s: no thread for peer %r: %s", self.name, peer_name, exc)
            with self._lock:
                self._inbound.discard(sock)
            return False
        return True

    def _serve(self, sock: socket.socket, peer_name: str) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._io_timeout)
            while True:
                self._serve_one(sock, peer_name)
        except (OSError, ValueError, _Stalled) as exc:  # ValueError: TLS socket closed by close()
            log.debug("transport %s: inbound connection ended: %s", self.name, exc)
        except KVFabricError as exc:
            log.info("transport %s: dropped a peer: %s", self.name, exc)
        finally:
            with self._lock:
                self._inbound.discard(sock)
            sock.close()

    def _wait_request(self, sock: socket.socket) -> bytes:
        """The next request's body; ``_Stalled`` after ``idle_timeout`` without one."""
        header = bytearray(HEADER)
        view = memoryview(header)
        sock.settimeout(self._idle_timeout)
        try:
            n = sock.recv_into(view)
        except TimeoutError:
            raise _Stalled("peer idle for too long") from None
        if n == 0:
            raise ConnectionError("peer closed the connection")
        sock.settimeout(self._io_timeout)
        try:
            _recv_exact(sock, view[n:])
            body = bytearray(frame_length(bytes(header)))
            _recv_exact(sock, memoryview(body))
        except TimeoutError:
            raise _Stalled("peer stalled mid-request") from None
        return bytes(body)

    def _serve_one(self, sock: socket.socket, peer_name: str) -> None:
        body = self._wait_request(sock)
        try:
            request = decode_body(body)
            op = request.get("op")
            if op == "notify":
                message = request.get("message")
                if not isinstance(message, bytes):
                    raise ProtocolError("notify needs a bytes message")
                self._notifications.append((peer_name, message))
                sock.sendall(encode_frame({"ok": True}))
            elif op in ("read", "write"):
                targets = self._resolve(_parse_pieces(request.get("pieces")))
                sock.sendall(encode_frame({"ok": True}))
                if op == "read":
                    for view in targets:
                        sock.sendall(view)
                else:
                    for view in targets:
                        _recv_exact(sock, view)
                    sock.sendall(encode_frame({"ok": True}))
            else:
                raise ProtocolError(f"unknown transport op {op!r}")
        except KVFabricError as exc:
            sock.sendall(encode_frame({"ok": False, "kind": exc.kind, "message": str(exc)}))
        except TimeoutError:
            raise _Stalled(f"peer {peer_name!r} stalled mid-transfer") from None

    def _resolve(self, pieces: list[tuple[int, int, int]]) -> list[memoryview]:
        views = []
        for region_id, offset, length in pieces:
            region = self.region_view(region_id)
            if region is None:
                raise ProtocolError(f"unknown region {region_id} on {self.name!r}")
            if offset < 0 or length <= 0 or offset + length > len(region):
                raise ProtocolError(
                    f"piece [{offset}, {offset + length}) outside region "
                    f"{region_id} of {len(region)} bytes on {self.name!r}"
                )
            views.append(region[offset : offset + length])
        return views


def _hung_up(sock: socket.socket) -> bool:
    """Whether a readable pooled socket really ended: a TLS socket is also readable for
    records that carry no data (session tickets), which a non-blocking read consumes."""
    if not isinstance(sock, ssl.SSLSocket):
        return True
    try:
        sock.settimeout(0)
        sock.recv(1)  # data nobody asked for, or EOF: the connection is unusable either way
        return True
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return False
    except OSError:
        return True
