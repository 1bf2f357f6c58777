"""The global index as the source of other nodes' chunks (real embedded index, nodes sharing
one state as daemons share Redis), followed into a RemoteInventory by its thread."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvfabric.cluster import ChunkRecord, EmbeddedIndex, EmbeddedState, NodeInfo
from kvfabric.hashing import ROOT, chunk_keys
from kvfabric.kvevents.remote import RemoteFollower, RemoteInventory
from kvfabric.server.remote_chunks import IndexRemoteSource
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)
NS = Namespace("model-a", SPEC)
PROMPT = list(range(40, 56))  # four chunks
CHAIN = chunk_keys(NS, PROMPT)


def tokens(i: int) -> bytes:
    return np.array(PROMPT[4 * i : 4 * i + 4], "<i4").tobytes()


def record(i: int, tier: str = "dram", with_tokens: bool = True) -> ChunkRecord:
    parent = CHAIN[i - 1] if i else ROOT
    return ChunkRecord(
        NS.seed, CHAIN[i], tier, parent, 4, tokens(i) if with_tokens else None, 4, ""
    )


def joined(state: EmbeddedState, name: str) -> EmbeddedIndex:
    index = EmbeddedIndex(state)
    index.register(NodeInfo(name, f"{name}:7000", ("dram", "ssd")))
    return index


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_resync_finds_token_ids_in_the_stream() -> None:
    state = EmbeddedState()
    a, b = joined(state, "a"), joined(state, "b")
    a.publish(stored=[record(0), record(1)])
    a.publish(stored=[record(2, with_tokens=False)])
    a.flush()
    view = IndexRemoteSource(b, page=1).resync()  # page 1: the stream is read page by page
    assert view.live == {"a": 1, "b": 1} and view.position == a.events(count=9)[-1].stream_id
    by_key = {u.key: u for u in view.chunks}
    assert [by_key[CHAIN[i]].tokens for i in range(3)] == [tokens(0), tokens(1), None]
    assert by_key[CHAIN[1]].parent == CHAIN[0] and by_key[CHAIN[1]].chunk_tokens == 4
    a.close(), b.close()


def test_reading_past_a_trimmed_position_is_a_gap() -> None:
    state = EmbeddedState(max_events=2)
    a, b = joined(state, "a"), joined(state, "b")
    source = IndexRemoteSource(b)
    a.publish(stored=[record(0)])
    a.flush()
    first = source.read("0-0", 0)
    assert not first.gap and [u.key for u in first.updates] == [CHAIN[0]]
    a.publish(removed=[record(0)])
    a.flush()
    second = source.read(first.position, 0)
    assert not second.gap and [u.stored for u in second.updates] == [False]  # control
    for i in range(1, 4):  # three more entries: the stream keeps two
        a.publish(stored=[record(i, "ssd")])
        a.flush()
    lost = source.read(second.position, 0)
    assert lost.gap and lost.position == second.position
    a.close(), b.close()


def test_the_follower_announces_stores_removals_and_lapsed_leases() -> None:
    state = EmbeddedState(lease_ttl=0.5)
    a, b = joined(state, "a"), joined(state, "b")
    a.publish(stored=[record(0)])  # before b follows: found by the first resync
    a.flush()
    inventory = RemoteInventory("b", 2, {"dram": "CPU", "ssd": "STORAGE"})
    follower = RemoteFollower(IndexRemoteSource(b), inventory, block_ms=50, live_every_s=0.1)
    follower.start()
    said: list[dict[str, object]] = []

    def events() -> list[dict[str, object]]:
        said.extend(inventory.take() or [])
        return said

    try:
        b.publish(stored=[ChunkRecord(NS.seed, CHAIN[3], "dram", CHAIN[2], 4, tokens(3), 4)])
        a.publish(stored=[record(1)])
        a.flush(), b.flush()
        wait_for(lambda: len(events()) == 2)  # b's own chunk is not among them
        assert [(e["type"], e["ownership"]) for e in said] == [("BlockStored", "kvfabric:a")] * 2
        a.publish(removed=[record(1)])
        a.flush()
        wait_for(lambda: len(events()) == 3)
        assert (said[2]["type"], said[2]["ownership"]) == ("BlockRemoved", "kvfabric:a")
        b.heartbeat()
        # a stops renewing its lease: its last claim goes once the lease lapses
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:
            b.heartbeat()
            time.sleep(0.05)
        wait_for(lambda: len(events()) == 4)
        assert (said[3]["type"], said[3]["medium"]) == ("BlockRemoved", "CPU")
        assert inventory.claims == 0 and follower.resyncs == 1
    finally:
        follower.close()
        a.close(), b.close()
