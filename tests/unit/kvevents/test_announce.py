"""A store's inventory as vLLM KV events: what the node says, checked with vLLM's own types.

Every payload here is decoded by vLLM's msgspec ``KVEventBatch`` decoder (the contract: a
consumer of vLLM events reads ours unchanged). The store is a real TieredStore (DRAM over
SSD); events are derived from its inventory listener through the change log.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from event_store import BLOCK, NS, SALTED, SPEC, make_store, media, put_prompt
from msgspec.msgpack import Decoder
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvfabric.hashing import ROOT, chunk_hashes
from kvfabric.kvevents.announce import Announcer, parents_first
from kvfabric.kvevents.blocks import block_hash, blocks_per_chunk, engine_blocks
from kvfabric.kvevents.log import ChangeLog
from kvfabric.kvevents.wire import encode_batch

DECODE = Decoder(KVEventBatch)


def decoded(announcer: Announcer, log: ChangeLog, after: int = 0) -> list[object]:
    events = announcer.events(log.read(after, 1 << 20).changes)
    return list(DECODE.decode(encode_batch(events)).events)


def test_blocks_split_chunks_and_chain_across_them() -> None:
    tokens = list(range(100, 164))
    first, second = chunk_hashes(NS, tokens)
    a = engine_blocks(first.key, ROOT, np.array(tokens[:32], "<i4").tobytes(), 32, BLOCK)
    b = engine_blocks(second.key, first.key, np.array(tokens[32:], "<i4").tobytes(), 32, BLOCK)
    assert a is not None and b is not None
    assert a.parent_hash is None and len(a.hashes) == 2
    assert b.parent_hash == a.hashes[-1]  # the chain continues across the chunk boundary
    assert list(a.token_ids + b.token_ids) == tokens
    partial = engine_blocks(second.key, first.key, np.arange(20, dtype="<i4").tobytes(), 32, 16)
    assert partial is not None and len(partial.hashes) == 1  # whole blocks only
    assert (
        engine_blocks(second.key, first.key, np.arange(15, dtype="<i4").tobytes(), 32, 16) is None
    )
    with pytest.raises(ValueError, match="not a multiple"):
        blocks_per_chunk(32, 12)
    assert block_hash(first.key, 0) != block_hash(second.key, 0) < 1 << 64


def test_stored_moved_and_removed_objects_become_vllm_events(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_chunks=3)
    log = ChangeLog()
    store.add_inventory_listener(log.on_inventory)
    announcer = Announcer(BLOCK, media(store), lambda ns: True)
    tokens = list(range(7, 7 + 80))  # two full chunks and a partial one of 16 tokens
    keys = put_prompt(store, NS, tokens)
    stored = decoded(announcer, log)
    assert [type(e) for e in stored] == [BlockStored] * 3
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" for e in stored)
    assert [t for e in stored for t in e.token_ids] == tokens  # type: ignore[attr-defined]
    assert stored[0].parent_block_hash is None  # type: ignore[attr-defined]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]  # type: ignore[attr-defined]

    position = log.next_seq
    put_prompt(store, NS, list(range(1000, 1096)))  # DRAM holds 3 chunks: older ones go down
    moved = decoded(announcer, log, position)
    removed = [e for e in moved if isinstance(e, BlockRemoved)]
    demoted = [e for e in moved if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert removed and demoted and {e.medium for e in removed} == {"CPU"}
    # a removal names what the store named, in the medium it named it in...
    first_hashes = {h for e in stored for h in e.block_hashes}  # type: ignore[attr-defined]
    assert {h for e in demoted for h in e.block_hashes} <= first_hashes
    assert {h for e in removed for h in e.block_hashes} >= {
        h for e in demoted for h in e.block_hashes
    }
    # ...and comes before the object is stored again: consumers must end up holding it
    assert moved.index(removed[0]) < moved.index(demoted[0])

    position = log.next_seq
    assert store.delete(NS, keys[-1])
    gone = decoded(announcer, log, position)
    assert [type(e) for e in gone] == [BlockRemoved]


def test_only_included_namespaces_with_tokens_are_announced(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    log = ChangeLog()
    store.add_inventory_listener(log.on_inventory)
    put_prompt(store, NS, list(range(64)))
    put_prompt(store, SALTED, list(range(64)))
    anonymous = chunk_hashes(NS, list(range(500, 532)))[0]  # a writer that gave no tokens
    store.put(NS, anonymous.key, np.zeros(SPEC.chunk_bytes, np.uint8))
    announcer = Announcer(BLOCK, media(store), lambda ns: not ns.tenant_salt)
    events = decoded(announcer, log)
    assert len(events) == 2  # NS's two chunks: not the tenant's, not the one without tokens
    assert announcer.unannounced == 1
    everyone = Announcer(BLOCK, media(store), lambda ns: True)
    assert len(decoded(everyone, log)) == 4  # negative control: the filter is what hid them
    odd = Announcer(12, media(store), lambda ns: True)  # 32-token chunks are not 12-token blocks
    assert decoded(odd, log) == []


def test_snapshot_clears_then_lists_parents_first(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    keys = put_prompt(store, NS, list(range(96)))
    announcer = Announcer(BLOCK, media(store), lambda ns: True)
    inventory = list(store.inventory())
    events = DECODE.decode(encode_batch(announcer.snapshot(reversed(inventory)))).events
    assert isinstance(events[0], AllBlocksCleared)
    assert [e.block_hashes[0] for e in events[1:]] == [block_hash(k, 0) for k in keys]  # type: ignore[union-attr]
    # negative control: without the ordering a child would come before its parent
    assert [o.key for o in reversed(inventory)] != [
        o.key for o in parents_first(reversed(inventory))
    ]


def test_a_write_is_announced_when_it_begins_and_withdrawn_when_abandoned(tmp_path: Path) -> None:
    """Lookups count an object from its reservation on; so do the events (the daemon's log
    listens in flight): a router hears of a prefix while it is being computed."""
    store = make_store(tmp_path)
    log, complete_only = ChangeLog(), ChangeLog()
    store.add_inventory_listener(log.on_inventory, in_flight=True)
    store.add_inventory_listener(complete_only.on_inventory)
    announcer = Announcer(BLOCK, media(store), lambda ns: True)
    tokens = list(range(300, 332))
    (ref,) = chunk_hashes(NS, tokens)
    writer = store.reserve(NS, ref.key, tokens=tokens)
    begun = decoded(announcer, log)
    assert [type(e) for e in begun] == [BlockStored]
    assert begun[0].token_ids == tokens  # type: ignore[attr-defined]
    assert decoded(announcer, complete_only) == []  # negative control: not complete yet
    position = log.next_seq
    writer.abort()
    withdrawn = decoded(announcer, log, position)
    assert [type(e) for e in withdrawn] == [BlockRemoved]
    assert withdrawn[0].block_hashes == begun[0].block_hashes  # type: ignore[attr-defined]
    assert decoded(announcer, complete_only) == []  # it never existed for them
