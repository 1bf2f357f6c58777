"""The recent-transfers ring (kvfabric/api/transfers.py), what the control plane records in
it (kvfabric/server/traffic.py), and its endpoint GET /v1/transfers/recent: bounded, newest
first, admin only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from app_daemon import app_daemon
from fastapi.testclient import TestClient

from kvfabric.api.app import MAX_TRANSFERS, create_app
from kvfabric.api.metrics import Metrics
from kvfabric.api.transfers import RecentTransfers
from kvfabric.config import AuthConfig
from kvfabric.protocol.messages import Op
from kvfabric.server.instrumented import InstrumentedPuller, InstrumentedPusher
from kvfabric.server.puller import PrefetchResult
from kvfabric.server.pusher import PushResult
from kvfabric.server.traffic import traffic_of
from kvfabric.spec import KVSpec
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
ADMIN_TOKEN, TENANT_TOKEN = "admin-secret", "acme-secret"
AUTH = AuthConfig(token=ADMIN_TOKEN, tenants={TENANT_TOKEN: "acme"})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---------------------------------------------------------------------- the ring


def test_the_ring_keeps_the_newest_capacity_entries_newest_first() -> None:
    ring = RecentTransfers(capacity=4)
    for i in range(10):
        ring.record("get", f"engine-{i}", i + 1, nbytes=100 * (i + 1))
    kept, recorded = ring.recent()
    assert recorded == 10 == ring.recorded and ring.capacity == 4
    assert [t.seq for t in kept] == [10, 9, 8, 7]
    assert [t.peer for t in kept] == ["engine-9", "engine-8", "engine-7", "engine-6"]
    assert kept[0].chunks == 10 and kept[0].nbytes == 1000 and kept[0].tokens is None
    assert kept[0].at >= kept[-1].at
    assert [t.seq for t in ring.recent(2)[0]] == [10, 9]
    assert ring.recent(100)[0] == kept  # a limit past what is kept: all of it


def test_the_ring_is_bounded_and_consistent_under_concurrent_writers() -> None:
    ring = RecentTransfers(capacity=64)
    writers, each = 8, 2000
    reads: list[list[int]] = []

    def write() -> None:
        for _ in range(each):
            ring.record("put", "w", 1, nbytes=1)

    def read() -> None:
        for _ in range(200):
            reads.append([t.seq for t in ring.recent()[0]])

    threads = [threading.Thread(target=write) for _ in range(writers)]
    threads.append(threading.Thread(target=read))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    kept, recorded = ring.recent()
    assert recorded == writers * each
    assert [t.seq for t in kept] == list(range(recorded, recorded - 64, -1))
    for seqs in reads:  # every read saw a consecutive run, newest first, never over capacity
        assert len(seqs) <= 64
        if seqs:
            assert seqs == list(range(seqs[0], seqs[0] - len(seqs), -1))


def test_a_ring_needs_room_for_one_entry() -> None:
    with pytest.raises(ValueError):
        RecentTransfers(capacity=0)


# ---------------------------------------------------------------------- what is recorded


def test_control_requests_that_move_kv_name_their_transfer() -> None:
    ok = {"ok": True, "result": {"nbytes": 4096, "num_tokens": 16}}
    bad = {"ok": False, "error": {"kind": "not_found"}}
    get = traffic_of(Op.GET, {"nbytes": 4096})
    assert get is not None and get.transfer() == ("get", 1, 4096, None)
    batch = traffic_of(Op.GET_BATCH, [ok, bad, ok])
    assert batch is not None and batch.transfer() == ("get", 2, 8192, None)
    reserve = traffic_of(Op.RESERVE, {"nbytes": 4096})
    assert reserve is not None and reserve.transfer() == ("put", 1, 4096, None)
    reserve_batch = traffic_of(Op.RESERVE_BATCH, [ok, ok, ok, bad])
    assert reserve_batch is not None and reserve_batch.transfer() == ("put", 3, 3 * 4096, None)
    serve = traffic_of(Op.PEER_PIN, [ok, ok])
    assert serve is not None and serve.transfer() == ("serve", 2, None, 32)
    # a lookup, or a batch where nothing moved, is no transfer
    lookup = traffic_of(Op.LOOKUP, {"tokens": 16, "requested_tokens": 32})
    assert lookup is not None and lookup.transfer() is None
    nothing = traffic_of(Op.GET_BATCH, [bad])
    assert nothing is not None and nothing.transfer() is None
    # the metric's arguments are what they were: the chunk count is not one of them
    assert "chunks" not in reserve.metric_counts()
    assert reserve.metric_counts()["bytes_written"] == 4096


class Answers:
    """A puller and a pusher that answer with given results (the wrappers' own logic is
    what is under test; real pulls and pushes need two daemons and a Redis)."""

    def __init__(self, *results: object) -> None:
        self.results = list(results)

    def prefetch(self, *_: object) -> object:
        return self.results.pop(0)

    def push(self, *_: object, **__: object) -> object:
        return self.results.pop(0)


def test_pulls_and_pushes_that_moved_or_missed_chunks_are_recorded(tmp_path: Path) -> None:
    store = TieredStore(
        StoreConfig(data_dir=str(tmp_path), tiers=(TierConfig(TierKind.DRAM, 1 << 20),)),
        maintenance=False,
    )
    try:
        metrics, ring = Metrics(store), RecentTransfers()
        puller = InstrumentedPuller(
            Answers(
                PrefetchResult(
                    pulled=3, already_local=1, missing=1, source="node-b", pulled_tokens=48
                ),
                PrefetchResult(pulled=0, already_local=4, missing=0, source=None),  # no move
            ),
            metrics,
            ring,
        )
        pusher = InstrumentedPusher(
            Answers(
                PushResult(pushed=2, already_there=0, failed=1, wire_bytes=8192, native_bytes=8192),
                PushResult(pushed=0, already_there=2, failed=0),  # nothing to move
            ),
            metrics,
            ring,
        )
        for _ in range(2):
            puller.prefetch(None, [], 1.0)
            pusher.push(None, [], "node-c", 1.0)
        push, pull = ring.recent()[0]
        assert ring.recorded == 2
        assert (pull.kind, pull.peer, pull.chunks, pull.tokens, pull.failed) == (
            "pull",
            "node-b",
            3,
            48,
            1,
        )
        assert (push.kind, push.peer, push.chunks, push.nbytes, push.failed) == (
            "push",
            "node-c",
            2,
            8192,
            1,
        )
        assert pull.seconds is not None and push.seconds is not None
    finally:
        store.close()


# ---------------------------------------------------------------------- the endpoint


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[SimpleNamespace]:
    with app_daemon(
        tmp_path, AUTH, 16 * SPEC.chunk_bytes, transfers=RecentTransfers(capacity=8)
    ) as daemon:
        yield daemon


@pytest.fixture
def client(daemon: SimpleNamespace) -> TestClient:
    return TestClient(create_app(daemon))


def test_recent_transfers_newest_first_with_their_fields(
    daemon: SimpleNamespace, client: TestClient
) -> None:
    daemon.transfers.record("put", "vllm", 3, nbytes=3 * 4096)
    daemon.transfers.record("pull", "node-b", 2, tokens=32, failed=1, seconds=0.25)
    response = client.get("/v1/transfers/recent", headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 200
    body = response.json()
    assert body["recorded"] == 2 and body["capacity"] == 8
    pull, put = body["transfers"]
    assert {k: v for k, v in pull.items() if k != "at"} == {
        "seq": 2,
        "kind": "pull",
        "peer": "node-b",
        "chunks": 2,
        "bytes": None,
        "tokens": 32,
        "failed": 1,
        "seconds": 0.25,
    }
    assert put["seq"] == 1 and put["kind"] == "put" and put["bytes"] == 3 * 4096
    assert put["seconds"] is None and put["tokens"] is None


def test_recent_transfers_limit_is_bounded(daemon: SimpleNamespace, client: TestClient) -> None:
    for _ in range(12):
        daemon.transfers.record("get", "vllm", 1, nbytes=1)
    admin = bearer(ADMIN_TOKEN)
    body = client.get("/v1/transfers/recent", params={"limit": 3}, headers=admin).json()
    assert [t["seq"] for t in body["transfers"]] == [12, 11, 10] and body["recorded"] == 12
    everything = client.get("/v1/transfers/recent", headers=admin).json()["transfers"]
    assert len(everything) == 8  # the ring's capacity, under the default limit
    for limit in (0, -1, MAX_TRANSFERS + 1, "x"):
        response = client.get("/v1/transfers/recent", params={"limit": limit}, headers=admin)
        assert response.status_code == 422, limit


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), (bearer("wrong"), 401), (bearer(TENANT_TOKEN), 403), (bearer(ADMIN_TOKEN), 200)],
)
def test_recent_transfers_are_for_the_admin_only(
    client: TestClient, headers: dict[str, str], status: int
) -> None:
    # they name every tenant's engines: a tenant token may not read them
    response = client.get("/v1/transfers/recent", headers=headers)
    assert response.status_code == status
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


def test_a_daemon_view_without_a_ring_reports_none(daemon: SimpleNamespace) -> None:
    del daemon.transfers
    client = TestClient(create_app(daemon))
    body = client.get("/v1/transfers/recent", headers=bearer(ADMIN_TOKEN)).json()
    assert body == {"transfers": [], "recorded": 0, "capacity": 0}
