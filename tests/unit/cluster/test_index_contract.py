"""One contract suite, run against the embedded and the Redis global index backends."""

from __future__ import annotations

import threading
import time

import pytest

from kvfabric.cluster import ChunkRecord, GlobalIndex, IndexSnapshot, KVEvent, NodeInfo
from kvfabric.errors import LeaseExpiredError
from kvfabric.hashing import ROOT, chunk_keys
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)
NS = Namespace("model-a", SPEC)
OTHER_NS = Namespace("model-a", SPEC, tenant_salt="tenant-b")
CHAIN = chunk_keys(NS, list(range(24)))  # six full chunks


def records(keys: list[bytes], tier: str, start: int = 0, ns: Namespace = NS) -> list[ChunkRecord]:
    """ChunkRecords of keys[start:], each chained to its predecessor in ``keys``."""
    return [
        ChunkRecord(ns.seed, keys[i], tier, keys[i - 1] if i else ROOT, 4)
        for i in range(start, len(keys))
    ]


def node(index: GlobalIndex, name: str, tiers: tuple[str, ...] = ("dram", "ssd")) -> NodeInfo:
    return index.register(
        NodeInfo(
            name,
            f"10.0.0.{len(name)}:7000",
            tiers,
            "h200",
            {"nixl": "ucx://x", "socket": "tcp://y"},
        )
    )


def owners(index: GlobalIndex, keys: list[bytes] = CHAIN, ns: Namespace = NS) -> list[set]:
    return [{(loc.node_id, loc.tier) for loc in row} for row in index.lookup(ns.seed, keys).owners]


def test_register_assigns_epochs_and_lists_live_nodes(make_index) -> None:
    a, b = make_index(), make_index()
    info_a, info_b = node(a, "n1"), node(b, "n2")
    assert info_a.epoch >= 1 and info_b.epoch >= 1
    listed = {n.node_id: n for n in a.nodes()}
    assert listed == {"n1": info_a, "n2": info_b}
    assert listed["n1"].transports == {"nixl": "ucx://x", "socket": "tcp://y"}
    assert listed["n1"].tiers == ("dram", "ssd")
    a.heartbeat()
    again = make_index()
    assert node(again, "n1").epoch == info_a.epoch + 1


def test_longest_prefix_across_nodes(make_index) -> None:
    a, b, c = make_index(), make_index(), make_index()
    node(a, "n1"), node(b, "n2"), node(c, "n3")
    a.publish(stored=records(CHAIN[:4], "dram"))
    b.publish(stored=records(CHAIN[:2], "ssd") + records(CHAIN[:6], "dram", start=4))
    c.publish(stored=records(CHAIN[:2], "dram", start=1))  # chunk 1 only: no prefix
    for index in (a, b, c):
        index.flush()
    result = c.lookup(NS.seed, CHAIN)
    assert result.requested_chunks == 6 and result.matched_chunks == 6 and not result.stale
    assert owners(c) == [
        {("n1", "dram"), ("n2", "ssd")},
        {("n1", "dram"), ("n2", "ssd"), ("n3", "dram")},
        {("n1", "dram")},
        {("n1", "dram")},
        {("n2", "dram")},
        {("n2", "dram")},
    ]
    per_node = result.nodes()
    assert {k: (v.chunks, v.tier_chunks) for k, v in per_node.items()} == {
        "n1": (4, {"dram": 4}),
        "n2": (2, {"ssd": 2}),
    }
    # A chain that diverges after chunk 2 matches only the shared prefix.
    other = CHAIN[:2] + chunk_keys(NS, list(range(100, 116)), parent=CHAIN[1])
    assert c.lookup(NS.seed, other).matched_chunks == 2
    assert c.lookup(NS.seed, []).matched_chunks == 0


def test_removal_shortens_the_prefix(make_index) -> None:
    a = make_index()
    node(a, "n1")
    a.publish(stored=records(CHAIN, "dram") + records(CHAIN[:3], "ssd"))
    a.flush()
    a.publish(removed=[records(CHAIN, "dram")[2]])
    a.flush()
    assert owners(a) == (
        [{("n1", "dram"), ("n1", "ssd")}] * 2 + [{("n1", "ssd")}] + [{("n1", "dram")}] * 3
    )
    a.publish(removed=records(CHAIN[:3], "ssd"))
    a.flush()
    assert a.lookup(NS.seed, CHAIN).matched_chunks == 2
    assert a.lookup(NS.seed, CHAIN).nodes()["n1"].tier_chunks == {"dram": 2}


def test_namespaces_are_separate(make_index) -> None:
    a = make_index()
    node(a, "n1")
    a.publish(stored=records(CHAIN, "dram"))
    a.flush()
    assert a.lookup(NS.seed, CHAIN).matched_chunks == 6
    assert a.lookup(OTHER_NS.seed, CHAIN).matched_chunks == 0


def test_new_epoch_hides_old_entries_at_once(make_index) -> None:
    old = make_index()
    node(old, "n1")
    old.publish(stored=records(CHAIN, "dram"))
    old.flush()
    restarted = make_index()
    node(restarted, "n1")  # a new daemon start: no sleep, no cleanup call
    assert restarted.lookup(NS.seed, CHAIN).matched_chunks == 0
    restarted.publish(stored=records(CHAIN[:2], "ssd"))
    restarted.flush()
    assert owners(restarted) == [{("n1", "ssd")}] * 2
    with pytest.raises(LeaseExpiredError):
        old.heartbeat()
    assert [n.epoch for n in restarted.nodes()] == [restarted.nodes()[0].epoch]
    assert all(
        ev.epoch != restarted.nodes()[0].epoch or ev.tier == "ssd"
        for ev in restarted.snapshot().events
    )
    assert {ev.tier for ev in restarted.snapshot().events} == {"ssd"}


def test_expired_lease_is_ignored_at_once(make_index) -> None:
    a, b = make_index(lease_ttl=0.4), make_index(lease_ttl=0.4)
    node(a, "n1"), node(b, "n2")
    a.publish(stored=records(CHAIN, "dram"))
    b.publish(stored=records(CHAIN[:3], "ssd"))
    a.flush(), b.flush()
    assert b.lookup(NS.seed, CHAIN).matched_chunks == 6
    deadline = time.monotonic() + 0.7
    while time.monotonic() < deadline:  # n2 keeps its lease, n1 stops heartbeating
        b.heartbeat()
        time.sleep(0.05)
    assert owners(b) == [{("n2", "ssd")}] * 3
    assert [n.node_id for n in b.nodes()] == ["n2"]
    assert {ev.node_id for ev in b.snapshot().events} == {"n2"}


def test_updates_are_batched_by_size_and_by_flush(make_index) -> None:
    a = make_index(flush_interval=30.0, max_batch=4)
    node(a, "n1")
    a.publish(stored=records(CHAIN[:4], "dram"))  # a full batch: sent without waiting 30 s
    deadline = time.monotonic() + 5
    while a.lookup(NS.seed, CHAIN).matched_chunks < 4:
        assert time.monotonic() < deadline, "a full batch was not sent"
        time.sleep(0.01)
    a.flush()  # nothing left to send: returns once the flusher is idle again
    a.publish(stored=records(CHAIN, "dram", start=4))
    time.sleep(0.2)
    assert a.lookup(NS.seed, CHAIN).matched_chunks == 4  # still queued
    a.flush()
    assert a.lookup(NS.seed, CHAIN).matched_chunks == 6
    # One event per chain run, not per chunk.
    stored = [ev for ev in a.events() if ev.kind == "stored"]
    assert [len(ev.keys) for ev in stored] == [4, 2]
    assert stored[1].parent == CHAIN[3] and stored[1].num_tokens == 8


def apply(view: dict, event: KVEvent) -> None:
    for key in event.keys:
        owners_ = view.setdefault((event.seed_hex, key), set())
        if event.kind == "stored":
            owners_.add((event.node_id, event.epoch, event.tier))
        else:
            owners_.discard((event.node_id, event.epoch, event.tier))
            if not owners_:
                del view[(event.seed_hex, key)]


def rebuild(snap: IndexSnapshot, later: list[KVEvent]) -> dict:
    view: dict = {}
    for event in snap.events + tuple(later):
        apply(view, event)
    return view


def test_events_resume_without_loss_or_duplicates(make_index) -> None:
    a, b = make_index(), make_index()
    info_a, info_b = node(a, "n1"), node(b, "n2")
    a.publish(stored=records(CHAIN, "dram"))
    a.flush()
    b.publish(stored=records(CHAIN[:3], "ssd", ns=OTHER_NS))
    b.flush()
    a.publish(removed=records(CHAIN, "dram", start=4))
    a.flush()
    everything = a.events(count=10_000)
    assert [(ev.kind, ev.node_id, len(ev.keys)) for ev in everything] == [
        ("stored", "n1", 6),
        ("stored", "n2", 3),
        ("removed", "n1", 2),
    ]
    assert everything[0].seed_hex == NS.seed.hex() and everything[0].epoch == info_a.epoch
    assert everything[1].seed_hex == OTHER_NS.seed.hex() and everything[1].tier == "ssd"
    # A consumer reads one event, "restarts" with the saved id, and reads the rest.
    first = a.events("0-0", count=1)
    rest = make_index().events(first[-1].stream_id, count=10_000)
    assert first + rest == everything
    assert make_index().events(everything[-1].stream_id) == []
    # snapshot + events after its id == the live state, at any point of the stream
    snap = a.snapshot()
    b.publish(stored=records(CHAIN[:4], "dram"))
    b.flush()
    later = a.events(snap.stream_id, count=10_000)
    assert [ev.node_id for ev in later] == ["n2"]
    expected = {(NS.seed.hex(), k): {("n1", info_a.epoch, "dram")} for k in CHAIN[:4]}
    for k in CHAIN[:3]:
        expected[(OTHER_NS.seed.hex(), k)] = {("n2", info_b.epoch, "ssd")}
    for k in CHAIN[:4]:
        expected[(NS.seed.hex(), k)].add(("n2", info_b.epoch, "dram"))
    assert rebuild(snap, later) == expected
    assert rebuild(a.snapshot(), []) == expected


def test_blocking_events_wait_for_the_next_event(make_index) -> None:
    a = make_index()
    node(a, "n1")
    start = time.monotonic()
    assert a.events(block_ms=300) == []
    assert time.monotonic() - start >= 0.25
    timer = threading.Timer(0.1, lambda: a.publish(stored=records(CHAIN[:1], "dram")))
    timer.start()
    got = make_index().events(block_ms=5000)
    timer.join()
    assert [(ev.kind, ev.keys) for ev in got] == [("stored", (CHAIN[0],))]
