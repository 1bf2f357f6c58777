"""Mutual TLS on the socket transport, on real loopback sockets with certificates made at test
time: chunk bytes no longer cross in the clear, a peer whose certificate comes from another
CA (or that has none, or speaks plain TCP) is refused, and TLS handshakes stay inside the
acceptor's deadline and caps without a thread per stranger."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from tls_certs import CA, client_context, server_context

from kvfabric.errors import AuthError, UnavailableError
from kvfabric.protocol.frames import encode_frame
from kvfabric.transport import PeerDescriptor, ReadPiece, SocketTransport, WritePiece
from kvfabric.transport.acceptor import AcceptLimits

SIZE = 1 << 20
_names = iter(range(1 << 30))


class Identity:
    """A node's certificate (signed by ``ca``) and the CA it trusts (``trusts``)."""

    def __init__(self, tmp: Path, ca: CA, trusts: CA | None = None) -> None:
        n = next(_names)
        self.cert = tmp / f"node{n}.pem"
        ca.issue(self.cert, f"node{n}")
        self.ca_file = (trusts or ca).write(tmp / f"trust{n}.pem")

    def transport(self, **kwargs: object) -> SocketTransport:
        return SocketTransport(
            f"n{next(_names)}",
            server_ssl=server_context(self.cert, self.ca_file),
            client_ssl=lambda: client_context(self.ca_file, self.cert),
            **kwargs,
        )  # type: ignore[arg-type]


@pytest.fixture
def ca() -> CA:
    return CA()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


class Recorder:
    """A TCP relay that keeps every byte passing through it, both ways."""

    def __init__(self, target_port: int) -> None:
        self.seen = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(("127.0.0.1", self._target))
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        except OSError:
            pass
        self._listener.close()


def via(recorder: Recorder, descriptor: bytes) -> bytes:
    """``descriptor`` pointing at the recorder (no cluster secret here: nothing to re-sign)."""
    desc = PeerDescriptor.decode(descriptor, None)
    return PeerDescriptor(
        desc.backend, desc.name, desc.regions, host="127.0.0.1", port=recorder.port, tls=desc.tls
    ).encode(None)


@pytest.mark.parametrize("tls", [True, False])
def test_chunk_bytes_cross_the_wire_encrypted_only_with_tls(
    tmp_path: Path, ca: CA, tls: bool
) -> None:
    """Regression: on the old code the socket transport had no TLS: a relay on the path saw
    every chunk byte (the plain run below still does, as the control)."""
    rng = np.random.default_rng(3)
    region = rng.integers(0, 256, SIZE, dtype=np.uint8)
    if tls:
        owner, member = Identity(tmp_path, ca).transport(), Identity(tmp_path, ca).transport()
    else:
        owner, member = SocketTransport("plain-owner"), SocketTransport("plain-member")
    recorder = Recorder(PeerDescriptor.decode(owner.descriptor(), None).port)
    try:
        owner.register(0, region)
        local = np.zeros(SIZE, np.uint8)
        member.register(0, local)
        peer = member.connect(via(recorder, owner.descriptor()), deadline=5.0)
        member.read(peer, [ReadPiece(0, 4096, local[: SIZE // 2])], deadline=5.0)
        assert np.array_equal(local[: SIZE // 2], region[4096 : 4096 + SIZE // 2])
        local[SIZE // 2 :] = rng.integers(0, 256, SIZE // 2, dtype=np.uint8)
        member.write(peer, [WritePiece(local[SIZE // 2 :], 0, 0)], deadline=5.0)
        assert np.array_equal(region[: SIZE // 2], local[SIZE // 2 :])
        assert owner.inbound_connections == 1
        served = next(iter(owner._inbound))
        assert isinstance(served, ssl.SSLSocket) is tls
        samples = [bytes(region[o : o + 64]) for o in (8192, 100_000, 300_000)]  # read, written
        assert any(sample in recorder.seen for sample in samples) is not tls
    finally:
        member.close()
        owner.close()
        recorder.close()


def test_a_peer_with_a_certificate_from_another_ca_is_refused(tmp_path: Path, ca: CA) -> None:
    """Regression (mTLS): on the old code anyone holding the cluster secret (or anyone at
    all, without one) got in; now the certificate must come from the cluster's CA too."""
    other = CA("another CA")
    owner = Identity(tmp_path, ca).transport()
    intruder = Identity(tmp_path, other, trusts=ca).transport()  # trusts us, we do not trust it
    doubter = Identity(tmp_path, other).transport()  # trusts only its own CA
    member = Identity(tmp_path, ca).transport()
    try:
        region = np.arange(4096, dtype=np.uint8)
        owner.register(0, region)
        with pytest.raises(AuthError, match="TLS with peer"):
            intruder.connect(owner.descriptor(), deadline=3.0)
        with pytest.raises(AuthError, match="not trusted"):
            doubter.connect(owner.descriptor(), deadline=3.0)
        assert wait_until(lambda: owner._acceptor.stats.failed >= 2)
        assert owner.inbound_connections == 0
        local = np.zeros(4096, np.uint8)
        member.register(0, local)
        peer = member.connect(owner.descriptor(), deadline=3.0)  # the CA's own get in
        member.read(peer, [ReadPiece(0, 0, local)], deadline=3.0)
        assert np.array_equal(local, region)
    finally:
        for transport in (member, doubter, intruder, owner):
            transport.close()


def test_plain_tcp_to_a_tls_port_is_refused(tmp_path: Path, ca: CA) -> None:
    """A plain transport is told of the mismatch (never a silent plain fallback either
    way); raw plain bytes are dropped at once without a greeting."""
    owner = Identity(tmp_path, ca).transport()
    plain = SocketTransport("plain")
    try:
        with pytest.raises(UnavailableError, match="speaks TLS on its transport"):
            plain.connect(owner.descriptor(), deadline=2.0)
        with pytest.raises(UnavailableError, match="does not speak TLS"):
            Identity(tmp_path, ca).transport().connect(plain.descriptor(), deadline=2.0)
        port = PeerDescriptor.decode(owner.descriptor(), None).port
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=3) as raw:
            raw.sendall(encode_frame({"v": 1, "name": "plain", "nonce": b"n" * 16, "mac": b""}))
            received = b""
            try:
                while data := raw.recv(4096):
                    received += data
            except ConnectionError:
                pass
        assert time.monotonic() - started < 2.0  # not the 5 s handshake deadline
        assert b"nonce" not in received  # no greeting, no frame: a TLS alert at most
        assert wait_until(lambda: owner._acceptor.stats.failed >= 1)
    finally:
        plain.close()
        owner.close()


def test_tls_handshakes_stay_inside_the_deadline_and_caps_without_threads(
    tmp_path: Path, ca: CA
) -> None:
    """Regression guard for the acceptor with TLS: strangers that open a TLS handshake and
    stall (half a ClientHello, or a full one and nothing more) cost no thread, are dropped
    at the deadline, and a member completes its handshake while they wait."""
    limits = AcceptLimits(handshake_timeout_s=1.0, max_handshakes=64, max_per_ip=16)
    owner = Identity(tmp_path, ca).transport(limits=limits)
    member = Identity(tmp_path, ca).transport()
    port = PeerDescriptor.decode(owner.descriptor(), None).port
    strangers: list[socket.socket] = []
    try:
        region = np.arange(4096, dtype=np.uint8)
        owner.register(0, region)
        threads = threading.active_count()
        hello = client_hello()
        for i in range(120):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((f"127.0.0.{2 + i % 10}", 0))
            sock.connect(("127.0.0.1", port))
            sock.sendall(hello[: len(hello) // 2] if i % 2 else hello)
            strangers.append(sock)
        assert wait_until(lambda: owner._acceptor.stats.accepted >= 120)
        assert threading.active_count() <= threads + 1
        assert owner.pending_handshakes <= 64
        local = np.zeros(4096, np.uint8)
        member.register(0, local)
        peer = member.connect(owner.descriptor(), deadline=3.0)
        member.read(peer, [ReadPiece(0, 0, local)], deadline=3.0)
        assert np.array_equal(local, region)
        assert wait_until(lambda: owner.pending_handshakes == 0, timeout=3.0)
        assert owner._acceptor.stats.timed_out >= 1 and owner.serving
        assert owner.inbound_connections == 1  # the member's
    finally:
        for sock in strangers:
            sock.close()
        member.close()
        owner.close()


def client_hello() -> bytes:
    """The bytes of a TLS ClientHello, as a stranger would send them (made in memory)."""
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    before = threading.active_count()
    yield
    assert wait_until(lambda: threading.active_count() <= before + 2, timeout=5.0)
