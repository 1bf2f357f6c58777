"""In-process transport tests: two transports on loopback, every backend that works here."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvfabric.errors import (
    AuthError,
    ConfigError,
    DeadlineExceededError,
    ProtocolError,
    UnavailableError,
)
from kvfabric.memory.arena import SharedArena
from kvfabric.protocol.frames import encode_frame
from kvfabric.transport import (
    PeerDescriptor,
    ReadPiece,
    SocketTransport,
    Transport,
    WritePiece,
    nixl_unavailable_reason,
    select_backend,
)
from kvfabric.transport.socket_backend import _recv_frame

PAGE = 64 << 10
PAGES = 32
# Both backends always run: tests/run.sh installs NIXL, and a machine where it does not
# work must fail here (with the reason), not quietly test only the fallback.
BACKENDS = ["socket", "nixl"]
_names = iter(range(1 << 30))


def make(backend: str, secret: bytes | None = None) -> Transport:
    return select_backend(backend)(f"t{next(_names)}-{backend}", secret=secret)


def wait_until(predicate, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple]:
    """(owner, owner_arena, consumer, consumer_arena, peer): the consumer connected to owner."""
    owner, consumer = make(request.param), make(request.param)
    owner_arena = SharedArena.create(PAGE * PAGES, PAGE)
    consumer_arena = SharedArena.create(PAGE * PAGES, PAGE)
    owner_arena.array[:] = np.random.default_rng(1).integers(0, 256, PAGE * PAGES, np.uint8)
    owner.register(7, owner_arena.array)
    consumer.register(3, consumer_arena.array)
    peer = consumer.connect(owner.descriptor(), deadline=2.0)
    yield owner, owner_arena, consumer, consumer_arena, peer
    consumer.close()
    owner.close()
    owner_arena.close()
    consumer_arena.close()


def test_read_many_pieces_byte_exact(pair: tuple) -> None:
    _, owner_arena, consumer, consumer_arena, peer = pair
    remote_pages = [5, 0, 31, 12, 13]  # scattered, out of order
    pieces = [ReadPiece(7, p * PAGE, consumer_arena.page(i)) for i, p in enumerate(remote_pages)]
    consumer.read(peer, pieces, deadline=2.0)
    for i, p in enumerate(remote_pages):
        assert np.array_equal(consumer_arena.page(i), owner_arena.page(p))
    assert not consumer_arena.page(len(remote_pages)).any()  # nothing written past the pieces


def test_write_many_pieces_byte_exact(pair: tuple) -> None:
    _, owner_arena, consumer, consumer_arena, peer = pair
    before = owner_arena.array.copy()
    consumer_arena.array[:] = np.random.default_rng(2).integers(0, 256, PAGE * PAGES, np.uint8)
    # Unaligned offsets and odd lengths: the transport must not assume page granularity.
    targets = [(0, 100, 1000), (3, 2 * PAGE + 17, PAGE + 5), (9, 30 * PAGE, 2 * PAGE)]
    pieces = [
        WritePiece(consumer_arena.array[src : src + n], 7, dst)
        for src, dst, n in [(s * PAGE, d, n) for s, d, n in targets]
    ]
    consumer.write(peer, pieces, deadline=2.0)
    expected = before.copy()
    for s, d, n in targets:
        expected[d : d + n] = consumer_arena.array[s * PAGE : s * PAGE + n]
    assert np.array_equal(owner_arena.array, expected)


@pytest.mark.parametrize(
    "region, offset, length, match",
    [
        (99, 0, 10, "region 99"),
        (7, PAGE * PAGES - 10, 11, "outside region 7"),
        (7, -1, 10, "outside region 7"),
    ],
)
def test_bounds_violations_refused_and_peer_keeps_serving(
    pair: tuple, region: int, offset: int, length: int, match: str
) -> None:
    _, owner_arena, consumer, consumer_arena, peer = pair
    before = owner_arena.array.copy()
    with pytest.raises(ProtocolError, match=match):
        consumer.read(peer, [ReadPiece(region, offset, consumer_arena.array[:length])], 2.0)
    with pytest.raises(ProtocolError, match=match):
        # The valid first piece must not land either: a request is checked whole.
        consumer.write(
            peer,
            [
                WritePiece(consumer_arena.page(1), 7, 0),
                WritePiece(consumer_arena.array[:length], region, offset),
            ],
            2.0,
        )
    assert np.array_equal(owner_arena.array, before)
    consumer.read(peer, [ReadPiece(7, PAGE, consumer_arena.page(0))], deadline=2.0)
    assert np.array_equal(consumer_arena.page(0), owner_arena.page(1))


def test_region_registered_later_reachable_after_reconnect(pair: tuple) -> None:
    owner, _, consumer, consumer_arena, _ = pair
    late = np.full(PAGE, 0xAB, np.uint8)
    owner.register(8, late)
    peer = consumer.connect(owner.descriptor(), deadline=2.0)
    consumer.read(peer, [ReadPiece(8, 0, consumer_arena.page(2))], deadline=2.0)
    assert np.array_equal(consumer_arena.page(2), late)
    owner.unregister(8)
    with pytest.raises(ProtocolError, match="region 8"):
        peer = consumer.connect(owner.descriptor(), deadline=2.0)
        consumer.read(peer, [ReadPiece(8, 0, consumer_arena.page(2))], deadline=2.0)


def test_local_buffer_must_be_registered(pair: tuple) -> None:
    _, _, consumer, _, peer = pair
    with pytest.raises(ValueError, match="not inside a region registered"):
        consumer.read(peer, [ReadPiece(7, 0, np.zeros(16, np.uint8))], deadline=2.0)


def test_notifications(pair: tuple) -> None:
    owner, _, consumer, _, peer = pair
    consumer.notify(peer, b"chunk-ready:42", deadline=2.0)
    end = time.monotonic() + 5
    received: list = []
    while not received and time.monotonic() < end:
        received = owner.poll_notifications()
        time.sleep(0.005)
    assert received == [(consumer.name, b"chunk-ready:42")]
    assert owner.poll_notifications() == []


def test_concurrent_reads_from_threads(pair: tuple) -> None:
    _, owner_arena, consumer, consumer_arena, peer = pair
    errors: list[BaseException] = []

    def pull(i: int) -> None:
        try:
            for _ in range(5):
                consumer.read(peer, [ReadPiece(7, (31 - i) * PAGE, consumer_arena.page(i))], 5.0)
        except Exception as exc:  # collected: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    for i in range(8):
        assert np.array_equal(consumer_arena.page(i), owner_arena.page(31 - i))


@pytest.mark.parametrize("backend", BACKENDS)
def test_descriptor_with_wrong_or_missing_secret_refused(backend: str) -> None:
    owner = make(backend, secret=b"cluster-A")
    owner.register(1, np.zeros(4096, np.uint8))
    try:
        with (
            make(backend, secret=b"cluster-B") as outsider,
            pytest.raises(AuthError, match="different cluster secret"),
        ):
            outsider.connect(owner.descriptor(), deadline=2.0)
        with make(backend, secret=b"cluster-A") as insider:
            insider.connect(owner.descriptor(), deadline=2.0)
            with make(backend) as open_owner, pytest.raises(AuthError, match="no credentials"):
                insider.connect(open_owner.descriptor(), deadline=2.0)
    finally:
        owner.close()


def test_socket_handshake_refuses_wrong_or_missing_secret() -> None:
    """A forged descriptor gets past decoding; the live challenge-response still refuses."""
    with SocketTransport("owner", secret=b"cluster-A") as owner:
        owner.register(1, np.zeros(4096, np.uint8))
        desc = PeerDescriptor.decode(owner.descriptor(), b"cluster-A")
        with (
            SocketTransport("forger", secret=b"cluster-B") as forger,
            pytest.raises(AuthError, match="different cluster secret"),
        ):
            forger.connect(desc.encode(b"cluster-B"), deadline=2.0)
        with (
            SocketTransport("anonymous") as anonymous,
            pytest.raises(AuthError, match="no credentials"),
        ):
            anonymous.connect(desc.encode(None), deadline=2.0)
        # A client with the secret must also refuse a server without it (mutual auth).
        with (
            SocketTransport("open-server") as open_server,
            SocketTransport("careful", secret=b"cluster-A") as careful,
        ):
            forged = PeerDescriptor.decode(open_server.descriptor(), None).encode(b"cluster-A")
            with pytest.raises(AuthError, match="no credentials"):
                careful.connect(forged, deadline=2.0)


class _SilentServer:
    """Accepts, optionally completes the handshake, then never answers again."""

    def __init__(self, handshake: bool) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.handshake = handshake
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(sock)
            if self.handshake:
                sock.sendall(encode_frame({"v": 1, "name": "silent", "nonce": b"n" * 16}))
                sock.recv(65536)
                sock.sendall(encode_frame({"ok": True, "mac": b""}))

    def descriptor(self) -> bytes:
        return PeerDescriptor("socket", "silent", (), host="127.0.0.1", port=self.port).encode(None)

    def close(self) -> None:
        self.listener.close()
        for sock in self.held:
            sock.close()


@pytest.mark.parametrize("handshake", [False, True])
def test_deadline_on_peer_that_never_answers(handshake: bool) -> None:
    server = _SilentServer(handshake)
    buffer = np.zeros(4096, np.uint8)
    try:
        with SocketTransport("caller") as caller:
            caller.register(0, buffer)
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                peer = caller.connect(server.descriptor(), deadline=0.5)
                caller.read(peer, [ReadPiece(0, 0, buffer)], deadline=0.5)
            assert time.monotonic() - start < 1.5
    finally:
        server.close()


def test_unreachable_and_closed() -> None:
    with SocketTransport("gone") as gone:
        desc = gone.descriptor()
    with SocketTransport("caller") as caller, pytest.raises(UnavailableError):
        caller.connect(desc, deadline=1.0)
    with pytest.raises(UnavailableError, match="closed"):
        caller.connect(desc, deadline=1.0)


def test_select_backend() -> None:
    assert select_backend("socket") is SocketTransport
    assert select_backend("auto").backend == (
        "nixl" if nixl_unavailable_reason() is None else "socket"
    )
    with pytest.raises(ConfigError, match="unknown transport 'rdma'"):
        select_backend("rdma")


def test_nixl_works_here() -> None:
    assert nixl_unavailable_reason() is None


def test_mixed_backends_refused() -> None:
    with (
        make("nixl") as nixl,
        make("socket") as sock,
        pytest.raises(ProtocolError, match="uses the 'nixl' transport"),
    ):
        sock.connect(nixl.descriptor(), deadline=1.0)


def test_pooled_connection_closed_by_peer_idle_timeout_is_skipped() -> None:
    region = np.arange(4096, dtype=np.uint8)
    local = np.zeros(4096, np.uint8)
    with SocketTransport("owner", idle_timeout=0.2) as owner, SocketTransport("c") as consumer:
        owner.register(0, region)
        consumer.register(0, local)
        peer = consumer.connect(owner.descriptor(), deadline=2.0)
        assert wait_until(lambda: owner.inbound_connections == 1)
        assert wait_until(lambda: owner.inbound_connections == 0)  # the owner dropped it
        consumer.read(peer, [ReadPiece(0, 0, local)], deadline=2.0)
        assert np.array_equal(local, region)


def test_malformed_requests_answered_and_connection_keeps_serving() -> None:
    with SocketTransport("owner") as owner:
        owner.register(0, np.arange(4096, dtype=np.uint8))
        desc = PeerDescriptor.decode(owner.descriptor(), None)
        with socket.create_connection((desc.host, desc.port), timeout=2.0) as sock:
            hello = _recv_frame(sock)
            sock.sendall(encode_frame({"v": 1, "name": "raw", "nonce": b"x" * 16, "mac": b""}))
            assert _recv_frame(sock)["ok"] is True and hello["v"] == 1
            for request, match in [
                ({"op": "read", "pieces": "junk"}, "non-empty list"),
                ({"op": "read", "pieces": [[0, 0, "9"]]}, "a piece must be"),
                ({"op": "read", "pieces": [[0, 0, True]]}, "a piece must be"),
                ({"op": "erase"}, "unknown transport op"),
                ({"op": "notify", "message": "str"}, "bytes message"),
            ]:
                sock.sendall(encode_frame(request))
                reply = _recv_frame(sock)
                assert reply["ok"] is False and reply["kind"] == "bad_request"
                assert match in reply["message"]
            sock.sendall(b"\x03\x00\x00\x00\xc1\xc1\xc1")  # a frame that is not msgpack
            assert _recv_frame(sock)["kind"] == "bad_request"
            sock.sendall(encode_frame({"op": "read", "pieces": [[0, 10, 5]]}))
            assert _recv_frame(sock)["ok"] is True
            data = b""
            while len(data) < 5:
                data += sock.recv(5 - len(data))
            assert data == bytes(range(10, 15))
