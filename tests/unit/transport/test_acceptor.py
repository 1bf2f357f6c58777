"""The socket transport's bounded accept + handshake (kvfabric.transport.acceptor), on real
loopback sockets: strangers cost no thread and are dropped at the deadline, the caps make
room for newcomers, an empty MAC never passes, a dead accept loop is reported."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvfabric.protocol.frames import encode_frame
from kvfabric.transport import PeerDescriptor, ReadPiece, SocketTransport
from kvfabric.transport.acceptor import AcceptLimits
from kvfabric.transport.socket_backend import _recv_frame

SECRET = b"s" * 32


def wait_until(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def stranger(port: int, source_ip: str) -> socket.socket:
    """A connection from ``source_ip`` (any 127/8 address is loopback) that never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source_ip, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server closed ``sock`` (EOF after the greeting, or a reset)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_a_flood_of_silent_connections_costs_no_thread_and_meets_the_deadline() -> None:
    """Regression: on the old code every inbound connection got a thread before its
    handshake, so 300 silent connections held 300 threads (until io_timeout, 30 s), and
    thread exhaustion ended the accept loop for good."""
    limits = AcceptLimits(handshake_timeout_s=1.0, max_handshakes=64, max_per_ip=16)
    region = np.arange(4096, dtype=np.uint8)
    with (
        SocketTransport("owner", secret=SECRET, limits=limits) as owner,
        SocketTransport("member", secret=SECRET) as member,
    ):
        owner.register(0, region)
        local = np.zeros(4096, np.uint8)
        member.register(0, local)
        port = PeerDescriptor.decode(owner.descriptor(), SECRET).port
        threads = threading.active_count()
        flood = [stranger(port, f"127.0.0.{2 + i % 20}") for i in range(300)]
        try:
            assert wait_until(lambda: owner._acceptor.stats.accepted >= 300)
            assert threading.active_count() <= threads + 1
            assert owner.pending_handshakes <= 64
            assert owner._acceptor.stats.evicted >= 300 - 64
            # a member completing its handshake promptly gets through while the flood is on
            peer = member.connect(owner.descriptor(), deadline=2.0)
            member.read(peer, [ReadPiece(0, 0, local)], deadline=2.0)
            assert np.array_equal(local, region)
            # the newest strangers are dropped once their deadline passes
            started = time.monotonic()
            assert all(closed_by_server(sock, 3.0) for sock in flood[-16:])
            assert time.monotonic() - started < 2.5
            assert wait_until(lambda: owner.pending_handshakes == 0)
            assert owner.serving and owner.inbound_connections == 1  # the member's
        finally:
            for sock in flood:
                sock.close()


@pytest.mark.parametrize("mac", [b"", None, b"\x00" * 32])
def test_an_empty_absent_or_wrong_mac_is_refused_when_a_secret_is_set(mac: bytes | None) -> None:
    """Regression guard for the finding "an empty MAC was accepted": with a secret, a client
    that sends no (or a wrong) MAC is answered unauthorized, closed, and never served."""
    with SocketTransport("owner", secret=SECRET) as owner:
        owner.register(0, np.arange(4096, dtype=np.uint8))
        desc = PeerDescriptor.decode(owner.descriptor(), SECRET)
        with socket.create_connection((desc.host, desc.port), timeout=2.0) as sock:
            assert _recv_frame(sock)["v"] == 1
            hello = {"v": 1, "name": "anonymous", "nonce": b"x" * 16}
            if mac is not None:
                hello["mac"] = mac
            sock.sendall(encode_frame(hello))
            reply = _recv_frame(sock)
            assert reply["ok"] is False and reply["kind"] == "unauthorized"
            sock.sendall(encode_frame({"op": "read", "pieces": [[0, 0, 16]]}))
            assert closed_by_server(sock, 2.0)
        assert owner.inbound_connections == 0 and owner._acceptor.stats.failed == 1


def test_an_oversized_handshake_frame_is_refused_unread() -> None:
    with SocketTransport("owner", secret=SECRET) as owner:
        desc = PeerDescriptor.decode(owner.descriptor(), SECRET)
        with socket.create_connection((desc.host, desc.port), timeout=2.0) as sock:
            _recv_frame(sock)
            sock.sendall((1 << 20).to_bytes(4, "little") + b"\x80" * 1024)
            reply = _recv_frame(sock)
            assert reply["ok"] is False and "handshake frame" in reply["message"]


def test_the_connection_cap_refuses_at_the_handshake() -> None:
    limits = AcceptLimits(max_connections=1)
    with (
        SocketTransport("owner", limits=limits) as owner,
        SocketTransport("a") as a,
        SocketTransport("b") as b,
    ):
        a.connect(owner.descriptor(), deadline=2.0)
        assert wait_until(lambda: owner.inbound_connections == 1)
        with pytest.raises(Exception, match="too many peer connections|cannot reach|closed"):
            b.connect(owner.descriptor(), deadline=2.0)


def test_a_listener_shut_down_under_the_loop_is_reported_not_serving() -> None:
    """Regression: on the old code the accept thread returned on any accept() error,
    silently, and nothing (readiness included) said the transport no longer accepted."""
    with SocketTransport("owner") as owner:
        assert owner.serving and owner.failure is None
        owner._listener.shutdown(socket.SHUT_RDWR)  # accept() now fails with EINVAL
        assert wait_until(lambda: not owner.serving)
        assert "accept loop ended" in (owner.failure or "")
