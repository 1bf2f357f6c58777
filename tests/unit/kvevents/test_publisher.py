"""The node's event stream over real ZMQ sockets, read the way vllm-router reads it.

A subscriber that starts late asks the replay socket for everything from seq 0 and must get
contiguous sequence numbers up to the live one (vllm-router drops what it knew otherwise).
The stream therefore never drops old batches: when its buffer is full it starts over at seq
0 with ``AllBlocksCleared`` and a snapshot. Both are checked here, with vLLM's own decoder.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from event_store import BLOCK, NS, SPEC, make_store, media, put_prompt
from msgspec.msgpack import Decoder
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvfabric.hashing import chunk_hashes
from kvfabric.kvevents.announce import Announcer
from kvfabric.kvevents.log import ChangeLog
from kvfabric.kvevents.publisher import EventStream
from kvfabric.kvevents.remote import RemoteInventory, RemoteUpdate
from kvfabric.store import TieredStore

DECODE = Decoder(KVEventBatch)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    s = make_store(tmp_path, dram_chunks=64)
    yield s
    s.close()


def start(
    store: TieredStore, remote: RemoteInventory | None = None, **kwargs: int
) -> tuple[EventStream, ChangeLog]:
    log = ChangeLog()
    store.add_inventory_listener(log.on_inventory)
    stream = EventStream(
        log,
        Announcer(BLOCK, media(store), lambda ns: True),
        store.inventory,
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        max_events_per_batch=2,
        remote=remote,
        **kwargs,
    )
    stream.start()
    return stream, log


def replay(endpoint: str, start_seq: int) -> list[tuple[int, KVEventBatch]]:
    """What vllm-router's DEALER does: ``[b"", start]``, then frames until seq -1."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(10_000), "no replay answer in 10 s"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return out
            assert topic == b""  # vllm-router drops any other topic
            out.append((number, DECODE.decode(payload)))
    finally:
        dealer.close()


def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_late_subscriber_replays_contiguously_from_zero(store: TieredStore) -> None:
    put_prompt(store, NS, list(range(64)))  # before the stream: in its first snapshot
    stream, log = start(store)
    try:
        put_prompt(store, NS, list(range(1000, 1096)))
        wait_for(lambda: stream.batches_published >= 3)
        wait_for(lambda: not log.read(0, 1 << 20).changes or stream._position == log.next_seq)
        batches = replay(stream.replay_endpoint or "", 0)
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        events = [e for _, b in batches for e in b.events]
        assert isinstance(events[0], AllBlocksCleared)
        tokens = [t for e in events if isinstance(e, BlockStored) for t in e.token_ids]
        assert sorted(tokens) == sorted([*range(64), *range(1000, 1096)])
        # a subscriber that saw seq 1 asks for the rest only
        assert [seq for seq, _ in replay(stream.replay_endpoint or "", 2)] == list(
            range(2, len(batches))
        )
    finally:
        stream.close()


def test_a_full_buffer_starts_the_stream_over_with_a_snapshot(store: TieredStore) -> None:
    stream, _ = start(store, buffer_batches=4)
    try:
        for i in range(6):  # 6 prompts of 2 chunks, 1 batch each: more than 4 batches
            put_prompt(store, NS, list(range(10_000 * (i + 1), 10_000 * (i + 1) + 64)))
        wait_for(lambda: stream.restarts >= 2)
        wait_for(lambda: len(replay(stream.replay_endpoint or "", 0)) >= 6)
        batches = replay(stream.replay_endpoint or "", 0)
        assert [seq for seq, _ in batches] == list(range(len(batches)))  # from 0, contiguous
        assert isinstance(batches[0][1].events[0], AllBlocksCleared)
        stored = {
            t
            for _, b in batches
            for e in b.events
            if isinstance(e, BlockStored)
            for t in e.token_ids
        }
        assert stored == {
            t for i in range(6) for t in range(10_000 * (i + 1), 10_000 * (i + 1) + 64)
        }
    finally:
        stream.close()


def test_a_malformed_replay_request_is_ignored(store: TieredStore) -> None:
    stream, _ = start(store)
    try:
        ctx = zmq.Context.instance()
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(stream.replay_endpoint or "")
        bad.send_multipart([b"", b"short"])
        assert not bad.poll(500)  # no answer to garbage...
        bad.close()
        assert replay(stream.replay_endpoint or "", 0)  # ...and the next subscriber is served
    finally:
        stream.close()


def test_other_nodes_chunks_follow_the_nodes_own_and_every_snapshot(store: TieredStore) -> None:
    remote = RemoteInventory("here", BLOCK, media(store))
    stream, _ = start(store, remote, buffer_batches=6)
    prompt = list(range(7000, 7000 + SPEC.chunk_tokens))
    (ref,) = chunk_hashes(NS, prompt)
    ids = np.array(prompt, "<i4").tobytes()
    try:
        put_prompt(store, NS, list(range(64)))  # the node's own
        remote.apply([RemoteUpdate(True, "a", 1, "dram", NS.seed, ref.key, ref.parent, ids, 32)])
        wait_for(
            lambda: any(
                e.ownership
                for _, b in replay(stream.replay_endpoint or "", 0)
                for e in b.events
                if isinstance(e, BlockStored)
            )
        )
        remote.apply([RemoteUpdate(False, "a", 1, "dram", NS.seed, ref.key)])
        wait_for(
            lambda: any(
                isinstance(e, BlockRemoved)
                for _, b in replay(stream.replay_endpoint or "", 0)
                for e in b.events
            )
        )
        events = [e for _, b in replay(stream.replay_endpoint or "", 0) for e in b.events]
        own = [e for e in events if isinstance(e, BlockStored) and not e.ownership]
        theirs = [e for e in events if isinstance(e, BlockStored) and e.ownership]
        (gone,) = [e for e in events if isinstance(e, BlockRemoved)]
        assert sorted(t for e in own for t in e.token_ids) == list(range(64))
        assert [(e.ownership, e.locality, e.token_ids) for e in theirs] == [
            ("kvfabric:a", "REMOTE", prompt)
        ]
        assert (gone.ownership, gone.medium, gone.block_hashes) == (
            "kvfabric:a",
            "CPU",
            theirs[0].block_hashes,
        )
        # held again, then the stream starts over: its snapshot names it with its ownership
        remote.apply([RemoteUpdate(True, "a", 1, "ssd", NS.seed, ref.key, ref.parent, ids, 32)])
        for i in range(6):
            put_prompt(store, NS, list(range(10_000 * (i + 1), 10_000 * (i + 1) + 64)))
        wait_for(lambda: stream.restarts >= 2)
        first = replay(stream.replay_endpoint or "", 0)[0][1].events
        assert isinstance(first[0], AllBlocksCleared)
        again = [e for _, b in replay(stream.replay_endpoint or "", 0) for e in b.events]
        assert [
            (e.ownership, e.medium) for e in again if isinstance(e, BlockStored) and e.ownership
        ] == [("kvfabric:a", "STORAGE")]
    finally:
        stream.close()
