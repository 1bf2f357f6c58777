"""Token ids in the global index's event stream: encoded per run, decoded strictly, and
absent from what the index itself keeps (snapshots), on every backend."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.cluster import ChunkRecord, EmbeddedIndex, EmbeddedState, KVEvent, NodeInfo
from kvfabric.cluster import events as codec
from kvfabric.errors import ProtocolError, SpecError
from kvfabric.hashing import ROOT, chunk_keys
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)
NS = Namespace("model-a", SPEC, lora_id="adapter-1")
PROMPT = list(range(100, 114))  # three full chunks and a partial one of 2 tokens
CHAIN = chunk_keys(NS, PROMPT)


TOKEN_FIELDS = {b"token_ids", b"token_counts", b"chunk_tokens", b"lora"}


def ids(tokens: list[int]) -> bytes:
    return np.array(tokens, dtype="<i4").tobytes()


def chunk_ids(i: int) -> bytes:
    return ids(PROMPT[4 * i : 4 * i + 4])


def records(tier: str = "dram", tokens: bool = True) -> list[ChunkRecord]:
    return [
        ChunkRecord(
            NS.seed,
            key,
            tier,
            CHAIN[i - 1] if i else ROOT,
            len(chunk_ids(i)) // 4,
            chunk_ids(i) if tokens else None,
            SPEC.chunk_tokens,
            NS.lora_id,
        )
        for i, key in enumerate(CHAIN)
    ]


def test_stored_events_carry_each_chunks_token_ids(make_index) -> None:
    a = make_index()
    a.register(NodeInfo("n1", "10.0.0.1:7000", ("dram", "ssd")))
    with_ids = records()
    # the last two chunks without token ids: a run holds chunks with token ids or none
    mixed = with_ids[:2] + [
        ChunkRecord(r.seed, r.key, "ssd", r.parent, r.num_tokens) for r in with_ids[2:]
    ]
    a.publish(stored=with_ids)
    a.publish(stored=[ChunkRecord(r.seed, r.key, "ssd", r.parent, r.num_tokens) for r in mixed])
    a.publish(removed=[ChunkRecord(NS.seed, CHAIN[3], "dram")])
    a.flush()
    stored, untokened, removed = a.events(count=100)
    assert stored.keys == tuple(CHAIN) and stored.num_tokens == len(PROMPT)
    assert stored.token_ids == tuple(chunk_ids(i) for i in range(4))
    assert (stored.chunk_tokens, stored.lora_id) == (4, "adapter-1")
    assert untokened.token_ids is None and untokened.tier == "ssd"
    assert removed.kind == "removed" and removed.token_ids is None
    # the index's own entries never hold them: a snapshot has none
    assert {ev.token_ids for ev in a.snapshot().events} == {None}


def test_first_event_id_is_the_oldest_the_stream_holds(make_index) -> None:
    a = make_index()
    a.register(NodeInfo("n1", "10.0.0.1:7000", ("dram",)))
    assert a.first_event_id() == "0-0"
    a.publish(stored=records()[:1])
    a.flush()
    a.publish(stored=records()[1:2])
    a.flush()
    assert a.first_event_id() == a.events(count=100)[0].stream_id


def test_a_trimmed_stream_moves_its_first_event_id() -> None:
    a = EmbeddedIndex(EmbeddedState(max_events=2))
    a.register(NodeInfo("n1", "10.0.0.1:7000", ("dram",)))
    for i in range(4):
        a.publish(removed=[ChunkRecord(NS.seed, CHAIN[i], "dram")])
        a.flush()
    first, *_ = a.events(count=100)
    assert a.first_event_id() == first.stream_id and len(a.events(count=100)) == 2
    a.close()


def stored_event(**changes: object) -> KVEvent:
    fields: dict[str, object] = {
        "kind": "stored",
        "keys": tuple(CHAIN),
        "tier": "dram",
        "node_id": "n1",
        "epoch": 3,
        "seed_hex": NS.seed.hex(),
        "parent": ROOT,
        "num_tokens": len(PROMPT),
        "token_ids": tuple(chunk_ids(i) for i in range(4)),
        "chunk_tokens": 4,
        "lora_id": "adapter-1",
    }
    return KVEvent(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_codec_round_trips_token_ids_and_reads_entries_without_them() -> None:
    ev = stored_event(stream_id="5-1")
    assert codec.decode("5-1", codec.encode(ev)) == ev
    # an entry of a writer that published no token ids (or of an older writer)
    old = {k: v for k, v in codec.encode(ev).items() if k not in TOKEN_FIELDS}
    assert set(old) == {b"kind", b"seed", b"keys", b"parent", b"tokens", b"tier", b"node", b"epoch"}
    assert codec.decode("5-1", old) == stored_event(
        stream_id="5-1", token_ids=None, chunk_tokens=0, lora_id=""
    )


@pytest.mark.parametrize(
    "damage",
    [
        {b"token_counts": b"\x04\x00\x00\x00" * 3},  # a count missing
        {b"token_ids": ids(PROMPT[:-1])},  # a token missing
        {b"token_counts": b"\x04\x00\x00\x00" * 3 + b"\x03\x00\x00\x00"},  # sum != tokens
        {b"chunk_tokens": b"2"},  # a chunk larger than chunk_tokens
        {b"chunk_tokens": b"x"},
        {b"lora": b"\xff"},
        {b"kind": b"removed"},  # token ids in a removal
    ],
)
def test_malformed_token_ids_are_refused(damage: dict[bytes, bytes]) -> None:
    fields = {**codec.encode(stored_event()), **damage}
    with pytest.raises(ProtocolError):
        codec.decode("5-1", fields)
    partial = codec.encode(stored_event())
    del partial[b"token_counts"]
    with pytest.raises(ProtocolError):
        codec.decode("5-1", partial)


def test_records_refuse_token_ids_that_do_not_match() -> None:
    with pytest.raises(SpecError):
        ChunkRecord(NS.seed, CHAIN[0], "dram", ROOT, 4, ids(PROMPT[:3]), 4)
    with pytest.raises(SpecError):
        ChunkRecord(NS.seed, CHAIN[0], "dram", ROOT, 4, chunk_ids(0), 2)  # over chunk_tokens
    with pytest.raises(SpecError):
        ChunkRecord(NS.seed, CHAIN[0], "dram", ROOT, 4, chunk_ids(0), 4, "x" * 5000)
