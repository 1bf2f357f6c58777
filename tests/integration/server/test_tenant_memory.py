"""Tenants own their memory (docs/architecture.md, "Tenants, quotas and authentication";
issue 11): real daemons with an admin token and two tenant tokens, clients that behave like
attackers with the descriptors they are handed, and real memfds.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import time
from array import array

import httpx
import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.errors import QuotaExceededError
from kvfabric.hashing import chunk_keys
from kvfabric.protocol.frames import FrameDecoder, encode_frame
from kvfabric.protocol.messages import Op, request
from kvfabric.spec import KVSpec, Namespace

ADMIN, TOKEN_A, TOKEN_B = "admin-5e0c", "tok-a", "tok-b"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=16)
CHUNK = SPEC.chunk_bytes  # 16 KiB
NS_A = Namespace("m", SPEC, tenant_salt="team-a")
NS_B = Namespace("m", SPEC, tenant_salt="team-b")
AUTH = [f"auth.token={ADMIN}", f"auth.tenants.{TOKEN_A}=team-a", f"auth.tenants.{TOKEN_B}=team-b"]
SMALL = [
    "store.tiers.dram.capacity=512KiB",
    "store.tiers.dram.page_size=4KiB",
    "store.tiers.ssd.capacity=16MiB",
]


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch) -> None:
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)


def payload(key: bytes, fill: int | None = None) -> np.ndarray:
    if fill is not None:
        return np.full(CHUNK, fill, dtype=np.uint8)
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, CHUNK, dtype=np.uint8
    )


def keys(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    return chunk_keys(ns, list(range(start, start + n * SPEC.chunk_tokens)))


def hello_with_fds(path: str, args: dict) -> tuple[dict, list[int], socket.socket]:
    """A raw hello: the reply, the descriptors passed with it, and the open connection."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(path)
    sock.sendall(encode_frame(request(1, Op.HELLO, args)))
    decoder, fds = FrameDecoder(), []
    while True:
        data, ancdata, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(253 * 4))
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array("i", cdata[: len(cdata) - len(cdata) % 4]))
        assert data, "closed during hello"
        for message in decoder.feed(data):
            assert message["ok"], message
            return message["result"], fds, sock


def test_a_tenant_gets_no_descriptor_that_reaches_another_tenants_bytes(start_daemon) -> None:
    """Regression: on the old code every session, a tenant's included, was handed the whole
    DRAM arena read-write: tenant A found tenant B's chunk in it and overwrote it (B's get
    then returned A's bytes). Now A's descriptors map A's arenas only: scanning all of them
    finds none of B's bytes, and scribbling over all of them leaves B's chunks intact."""
    daemon = start_daemon(*AUTH, *SMALL)
    b_keys = keys(NS_B, 8)
    with Client(daemon.socket, token=TOKEN_B) as b:
        for key in b_keys:
            assert b.put(NS_B, key, payload(key))
    with Client(daemon.socket, token=TOKEN_A) as a:
        a.put(NS_A, keys(NS_A, 1)[0], payload(b"", fill=1))  # A's own arena has data too
        hello, fds, sock = hello_with_fds(daemon.socket, {"token": TOKEN_A, "client": "evil"})
        try:
            assert fds and all(arena["tier"] == "dram" for arena in hello["arenas"])
            for fd in fds:
                region = mmap.mmap(
                    fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
                )
                content = bytes(region)
                assert not any(payload(key).tobytes()[:256] in content for key in b_keys)
                region[:] = b"\xa5" * len(region)  # scribble over everything it can reach
                region.close()
        finally:
            sock.close()
            for fd in fds:
                os.close(fd)
    with Client(daemon.socket, token=TOKEN_B) as b:
        for key in b_keys:
            with b.get(NS_B, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
    with Client(daemon.socket, token=ADMIN) as admin:  # the admin maps every arena
        assert len(admin._session().hello["arenas"]) == 3
        for key in b_keys[:2]:
            with admin.get(NS_B, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()


def test_a_client_cannot_resize_an_arena_and_the_daemon_survives(start_daemon) -> None:
    """Regression: on the old code a client could ftruncate the arena memfd it was handed:
    new clients then failed to map it, and the daemon died of SIGBUS at its next demotion or
    at shutdown (0 of 40 chunks survived)."""
    daemon = start_daemon(*AUTH, *SMALL)
    with Client(daemon.socket, token=TOKEN_B) as b:
        b_keys = keys(NS_B, 40)
        for key in b_keys:
            assert b.put(NS_B, key, payload(key))
    for token in (TOKEN_A, TOKEN_B, ADMIN):
        _, fds, sock = hello_with_fds(daemon.socket, {"token": token})
        try:
            for fd in fds:
                for size in (0, 4096, 1 << 30):
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, size)
        finally:
            sock.close()
            for fd in fds:
                os.close(fd)
    with Client(daemon.socket, token=TOKEN_B) as b:  # new clients map it; memory churns
        for key in keys(NS_B, 80, 10_000):
            assert b.put(NS_B, key, payload(key))
        for key in b_keys:
            with b.get(NS_B, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
    assert daemon.stop() == 0  # a clean shutdown, not SIGBUS (-7)


def test_a_read_only_session_maps_read_only_and_cannot_reserve(start_daemon) -> None:
    daemon = start_daemon(*AUTH, *SMALL)
    (key,) = keys(NS_A, 1)
    with Client(daemon.socket, token=TOKEN_A) as a:
        assert a.put(NS_A, key, payload(key))
    hello, fds, sock = hello_with_fds(daemon.socket, {"token": TOKEN_A, "access": "read"})
    try:
        assert [arena["writable"] for arena in hello["arenas"]] == [False]
        for fd in fds:
            with pytest.raises(PermissionError):
                mmap.mmap(
                    fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
                )
            with pytest.raises(OSError):
                os.write(fd, b"x")
            region = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
            assert payload(key).tobytes()[:256] in bytes(region)
            region.close()
        sock.sendall(
            encode_frame(request(2, Op.RESERVE, {"ns": _wire(NS_A), "key": keys(NS_A, 1, 99)[0]}))
        )
        decoder = FrameDecoder()
        replies: list = []
        while not replies:
            replies.extend(decoder.feed(sock.recv(1 << 16)))
        assert replies[0]["ok"] is False and replies[0]["error"]["kind"] == "forbidden"
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)


def _wire(ns: Namespace) -> dict:
    from kvfabric.protocol.messages import encode_namespace

    return encode_namespace(ns)


def test_a_writer_frozen_past_its_lease_cannot_corrupt_other_objects(start_daemon) -> None:
    """Regression: on the old code an expired reservation's pages were freed at the deadline
    and handed to other objects while the frozen writer still held its mapping; when it
    resumed writing, another client's chunk was served with its bytes (1 of 16 wrong).
    Now the pages stay quarantined until the writer's session ends."""
    daemon = start_daemon(
        *AUTH,
        "store.tiers.dram.capacity=160KiB",
        "store.tiers.dram.page_size=4KiB",
        "store.tiers.ssd.capacity=16MiB",
        "store.reservation_timeout_s=0.5",
        "store.maintenance_interval_s=0.05",
    )
    frozen_client = Client(daemon.socket, token=TOKEN_A)
    try:
        writer = frozen_client.reserve(NS_A, keys(NS_A, 1)[0])
        views = writer.layer_pieces(0) + writer.layer_pieces(1)  # mid-copy when it froze
        time.sleep(1.5)  # frozen past its deadline: the daemon aborts the reservation
        others = keys(NS_A, 16, 1000)
        with Client(daemon.socket, token=TOKEN_A) as other:
            for key in others:  # the memory is wanted: the pool is full, pages turn over
                assert other.put(NS_A, key, payload(key))
            for view in views:  # the frozen writer wakes up and finishes its copy
                view[:] = 0xEE
            wrong = []
            for key in others:
                with other.get(NS_A, key) as reader:
                    if reader.to_bytes() != payload(key).tobytes():
                        wrong.append(key.hex())
            assert wrong == []
    finally:
        frozen_client.close()


def test_one_tenant_cannot_starve_another_of_dram(start_daemon) -> None:
    """Regression: on the old code one tenant holding all DRAM in renewed reservations made
    the other's puts fail with no_capacity (569 of 578). With a quota per tenant it gets
    quota_exceeded itself, and the other tenant's puts all succeed."""
    daemon = start_daemon(*AUTH, *SMALL, "store.quotas.*.dram=50%")
    with Client(daemon.socket, token=TOKEN_A) as a, Client(daemon.socket, token=TOKEN_B) as b:
        held = []
        with pytest.raises(QuotaExceededError):
            for key in keys(NS_A, 64):
                held.append(a.reserve(NS_A, key))  # held, never committed
        assert len(held) == 16  # half of 512 KiB in 16 KiB chunks
        failed = 0
        for key in keys(NS_B, 200, 10_000):
            try:
                b.put(NS_B, key, payload(key))
            except Exception:
                failed += 1
        assert failed == 0
        for writer in held:
            writer.abort()


def test_reserve_and_abort_in_new_namespaces_leaves_nothing_behind(start_daemon) -> None:
    """Regression: on the old code every namespace a tenant reserved in stayed in the
    store's table for good: one tenant's 60,536 reserve+abort calls filled it for every
    tenant. Now an emptied namespace is forgotten, so after 2,000 of them the tenant still
    has its whole namespace quota, and only its quota is refused."""
    daemon = start_daemon(*AUTH, *SMALL, "store.quotas.team-a.namespaces=4")
    with Client(daemon.socket, token=TOKEN_A) as a:
        for i in range(2000):
            ns = Namespace(f"model-{i}", SPEC, tenant_salt="team-a")
            a.reserve(ns, keys(ns, 1)[0]).abort()
        for i in range(4):
            ns = Namespace(f"kept-{i}", SPEC, tenant_salt="team-a")
            assert a.put(ns, keys(ns, 1)[0], payload(b"", fill=i))
        extra = Namespace("one-too-many", SPEC, tenant_salt="team-a")
        with pytest.raises(QuotaExceededError):
            a.put(extra, keys(extra, 1)[0], payload(b"", fill=9))
    with Client(daemon.socket, token=TOKEN_B) as b:  # another tenant is not affected
        for i in range(8):
            ns = Namespace(f"model-b{i}", SPEC, tenant_salt="team-b")
            assert b.put(ns, keys(ns, 1)[0], payload(b"", fill=3))


def test_lookups_in_empty_namespaces_take_no_tenant_label(start_daemon) -> None:
    """Regression: on the old code a lookup in any namespace took a tenant label slot in
    the metrics (256 of them), so 300 lookups with made-up tenant salts pushed a real
    tenant's counts under ``__other__``. Now only namespaces that hold data get one."""
    daemon = start_daemon(*SMALL)
    real = Namespace("m", SPEC, tenant_salt="real-tenant")
    with Client(daemon.socket) as client:
        for i in range(300):
            ghost = Namespace("m", SPEC, tenant_salt=f"ghost-{i}")
            client.lookup(ghost, keys=keys(ghost, 1))
        key = keys(real, 1)[0]
        assert client.put(real, key, payload(key))
        assert client.lookup(real, keys=[key]).matched_chunks == 1
    text = httpx.get(f"{daemon.http_url}/metrics", timeout=30).text
    assert 'tenant="real-tenant"' in text
    assert 'tenant="ghost-' not in text


def memory_mb(pid: int) -> float:
    """What the daemon holds: its anonymous RSS plus the memory of its arenas (the memfds'
    blocks: pages clients wrote are in them, though never in the daemon's own RSS)."""
    with open(f"/proc/{pid}/status") as status:
        anon = next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))
    arenas: dict[int, int] = {}  # by inode: an arena has several descriptors
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:kvfabric"):
                stat = os.stat(path)
                arenas[stat.st_ino] = stat.st_blocks * 512
        except OSError:
            pass  # closed meanwhile
    return (anon + sum(arenas.values())) / (1 << 20)


def test_rss_comes_back_after_evicting_everything(start_daemon) -> None:
    """Regression: on the old code the daemon's memory stayed at its peak after an
    evict-all (44 -> 172 MB for 45,768 objects): freed arena pages kept their memory for
    good, and the index's tables their peak size."""
    daemon = start_daemon(
        "store.tiers.dram.capacity=256MiB",
        "store.tiers.dram.page_size=4KiB",
        "store.tiers.ssd.capacity=16MiB",
        "store.persist_on_close=false",
        "store.maintenance_interval_s=0.1",
        "store.high_watermark=1.0",
        "store.low_watermark=1.0",
        "store.free_memory_kept=0.05",
    )
    pid = daemon.proc.pid
    spec = KVSpec(
        num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", chunk_tokens=64
    )  # 128 KiB chunks
    ns = Namespace("rss", spec)
    data = np.ones(spec.chunk_bytes, dtype=np.uint8)
    with Client(daemon.socket) as client:
        client.ping()
        baseline = memory_mb(pid)
        all_keys = chunk_keys(ns, list(range(1200 * 64)))  # 150 MiB
        for key in all_keys:
            client.put(ns, key, data)
        peak = memory_mb(pid)
        assert peak - baseline > 100, (baseline, peak)
        response = httpx.post(f"{daemon.http_url}/v1/admin/evict", json={}, timeout=60)
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 10
        limit = baseline + 0.3 * (peak - baseline)
        while time.monotonic() < deadline and memory_mb(pid) > limit:
            time.sleep(0.2)
        after = memory_mb(pid)
        assert after - baseline <= 0.3 * (peak - baseline), (baseline, peak, after)
        assert client.lookup(ns, keys=all_keys[:4]).matched_chunks == 0
    assert daemon.proc.poll() is None
    daemon.proc.send_signal(signal.SIGTERM)
