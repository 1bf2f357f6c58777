"""Node ids cannot collide by accident: a live node's id is refused to a second daemon, on the
embedded index, a real redis-server and a real 3-master Redis Cluster (``make_index``)."""

from __future__ import annotations

import threading

import pytest

from kvfabric.cluster import ChunkRecord, NodeInfo
from kvfabric.errors import AlreadyExistsError, DuplicateNodeError, LeaseExpiredError
from kvfabric.hashing import ROOT, chunk_keys
from kvfabric.spec import KVSpec, Namespace

NS = Namespace("model-a", KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4))
CHAIN = chunk_keys(NS, list(range(8)))


def info(address: str, node_id: str = "n1") -> NodeInfo:
    return NodeInfo(node_id, address, ("dram",), "h200")


def test_a_live_node_id_under_another_address_is_refused(make_index) -> None:
    """Regression: on the old code the second daemon took the id over silently (a new epoch
    hid the first one's chunks, whose heartbeat then failed)."""
    first, second = make_index(), make_index()
    live = first.register(info("host-a:7000"))
    first.publish(stored=[ChunkRecord(NS.seed, CHAIN[0], "dram", ROOT, 4)])
    first.flush()
    with pytest.raises(DuplicateNodeError, match=r"'n1' is already registered.*host-a:7000"):
        second.register(info("host-a:7001"))
    assert isinstance(DuplicateNodeError("x"), AlreadyExistsError)
    first.heartbeat()  # untouched: still the live owner, same epoch, same chunks
    assert [(n.node_id, n.epoch) for n in second.nodes()] == [("n1", live.epoch)]
    assert second.lookup(NS.seed, CHAIN).matched_chunks == 1


def test_a_node_that_keeps_renewing_is_refused_after_watching(make_index) -> None:
    """Regression: on the old code a renewing live node was replaced."""
    first, second = make_index(lease_ttl=5.0), make_index(lease_ttl=5.0)
    first.register(info("host-a:7000"))
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(0.05):
            first.heartbeat()

    thread = threading.Thread(target=renew)
    thread.start()
    try:
        with pytest.raises(DuplicateNodeError):
            second.register(info("host-b:7000"), takeover_after_s=1.0)
    finally:
        stop.set()
        thread.join()
    first.heartbeat()  # still its lease


def test_a_dead_node_under_another_address_is_taken_over(make_index) -> None:
    """A crashed daemon restarted on another (random) port: its lease is not renewed while
    the new incarnation watches, so it takes the id over long before the lease lapses."""
    old, restarted = make_index(lease_ttl=30.0), make_index(lease_ttl=30.0)
    first = old.register(info("host-a:41000"))
    new = restarted.register(info("host-a:41999"), takeover_after_s=0.3)
    assert new.epoch > first.epoch
    with pytest.raises(LeaseExpiredError):
        old.heartbeat()


def test_the_same_address_and_re_registering_are_restarts(make_index) -> None:
    old, restarted = make_index(), make_index()
    first = old.register(info("host-a:7000"))
    again = restarted.register(info("host-a:7000"))  # same address: a restart, at once
    assert again.epoch > first.epoch
    renewed = restarted.register(info("host-a:7000"))  # the same handle: a new epoch, no check
    assert renewed.epoch > again.epoch
    other = make_index().register(info("host-b:7000", node_id="n2"))  # other ids: unaffected
    assert other.node_id == "n2"
