"""Other nodes' chunks as this node's vLLM KV events, checked with vLLM's own types.

Every payload is decoded by vLLM's msgspec ``KVEventBatch`` decoder. The updates are what
the daemon makes of the global index's events (:mod:`kvfabric.server.remote_chunks`).
"""

from __future__ import annotations

import numpy as np
from event_store import BLOCK, NS, SPEC
from msgspec.msgpack import Decoder
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvfabric.hashing import ROOT, chunk_hashes
from kvfabric.kvevents.blocks import block_hash
from kvfabric.kvevents.remote import RemoteInventory, RemoteUpdate
from kvfabric.kvevents.wire import Event, encode_batch

DECODE = Decoder(KVEventBatch)
MEDIA = {"dram": "CPU", "ssd": "STORAGE"}
PROMPT = list(range(500, 500 + 3 * SPEC.chunk_tokens))
REFS = chunk_hashes(NS, PROMPT)


def decoded(events: list[Event] | None) -> list[object]:
    assert events is not None
    return list(DECODE.decode(encode_batch(events)).events)


def stored(
    node: str, i: int, tier: str = "dram", epoch: int = 1, tokens: bool = True
) -> RemoteUpdate:
    step = SPEC.chunk_tokens
    ids = np.array(PROMPT[i * step : (i + 1) * step], "<i4").tobytes()
    return RemoteUpdate(
        True,
        node,
        epoch,
        tier,
        NS.seed,
        REFS[i].key,
        REFS[i].parent,
        ids if tokens else None,
        step,
        "",
    )


def removed(node: str, i: int, tier: str = "dram", epoch: int = 1) -> RemoteUpdate:
    return RemoteUpdate(False, node, epoch, tier, NS.seed, REFS[i].key)


def test_other_nodes_chunks_are_announced_with_their_ownership() -> None:
    inv = RemoteInventory("b", BLOCK, MEDIA)
    inv.apply([stored("a", 0), stored("a", 1, "ssd"), stored("c", 0, "cxl")])
    events = decoded(inv.take())
    assert [type(e) for e in events] == [BlockStored] * 3
    first, second, third = events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert isinstance(third, BlockStored)
    assert (first.ownership, first.locality, first.medium) == ("kvfabric:a", "REMOTE", "CPU")
    assert (second.medium, third.ownership, third.medium) == ("STORAGE", "kvfabric:c", "CPU")
    assert first.token_ids + second.token_ids == PROMPT[: 2 * SPEC.chunk_tokens]
    assert first.block_hashes == [block_hash(REFS[0].key, j) for j in range(2)]
    assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[-1]
    assert first.block_size == BLOCK and first.lora_name is None
    assert inv.take() == []  # taken once


def test_a_removal_names_the_same_ownership_and_medium() -> None:
    inv = RemoteInventory("b", BLOCK, MEDIA)
    inv.apply([stored("a", 0), stored("a", 0, "ssd")])
    said = decoded(inv.take())
    inv.apply([removed("a", 0, "ssd"), removed("c", 0)])  # c never held it: nothing to say
    (gone,) = decoded(inv.take())
    assert isinstance(gone, BlockRemoved)
    assert (gone.ownership, gone.locality, gone.medium) == ("kvfabric:a", "REMOTE", "STORAGE")
    assert gone.block_hashes == said[1].block_hashes  # type: ignore[attr-defined]
    assert inv.claims == 1


def test_one_claim_per_medium_ends_with_its_last_tier() -> None:
    inv = RemoteInventory("b", BLOCK, {"dram": "CPU", "cxl": "CPU"})
    inv.apply([stored("a", 0, "dram"), stored("a", 0, "cxl")])
    assert len(decoded(inv.take())) == 1  # both tiers are one claim: (kvfabric:a, CPU)
    inv.apply([removed("a", 0, "dram")])
    assert inv.take() == []  # still held in cxl
    inv.apply([removed("a", 0, "cxl")])
    assert [type(e) for e in decoded(inv.take())] == [BlockRemoved]


def test_the_nodes_own_chunks_are_not_announced_as_remote() -> None:
    inv = RemoteInventory("b", BLOCK, MEDIA)
    inv.apply([stored("b", 0), removed("b", 0)])
    inv.resync([stored("b", 1)], {"b": 1})
    assert inv.take() == [] and inv.claims == 0
    inv.apply([stored("a", 0)])  # negative control: another node's are
    assert len(decoded(inv.take())) == 1


def test_chunks_without_token_ids_are_counted_not_announced() -> None:
    inv = RemoteInventory("b", BLOCK, MEDIA)
    inv.apply([stored("a", 0, tokens=False)])
    assert inv.take() == [] and inv.unannounced == 1


def test_a_lapsed_lease_or_a_restart_removes_the_owners_claims() -> None:
    inv = RemoteInventory("b", BLOCK, MEDIA)
    inv.apply([stored("a", 0), stored("c", 0)])
    inv.take()
    inv.expire({"a": 1, "c": 1, "b": 4})
    assert inv.take() == []  # both live
    inv.expire({"c": 1})  # a's lease lapsed
    (gone,) = decoded(inv.take())
    assert isinstance(gone, BlockRemoved) and gone.ownership == "kvfabric:a"
    inv.apply([stored("a", 1, epoch=1)])  # a late update of the lapsed incarnation
    inv.expire({"c": 1})  # still gone, a second time
    assert inv.take() == []
    inv.apply([stored("a", 0, epoch=2)])  # its next incarnation
    assert [e.ownership for e in decoded(inv.take())] == ["kvfabric:a"]  # type: ignore[attr-defined]
    inv.apply([stored("c", 0, "ssd", epoch=2)])  # c restarted: its old claims go first
    restart = decoded(inv.take())
    assert [(type(e), e.medium) for e in restart] == [  # type: ignore[attr-defined]
        (BlockRemoved, "CPU"),
        (BlockStored, "STORAGE"),
    ]


def test_a_resync_says_the_difference_and_keeps_known_token_ids() -> None:
    inv = RemoteInventory("b", BLOCK, MEDIA)
    inv.apply([stored("a", 0), stored("a", 1), stored("c", 0)])
    before = decoded(inv.take())
    # the index's view: a still holds 0 (token ids not in the snapshot: kept from before),
    # a now holds 2 (with them), 1 is gone, c's lease lapsed
    inv.resync([stored("a", 0, tokens=False), stored("a", 2), stored("c", 0)], {"a": 1})
    diff = decoded(inv.take())
    assert sorted((type(e).__name__, e.ownership) for e in diff) == [  # type: ignore[attr-defined]
        ("BlockRemoved", "kvfabric:a"),
        ("BlockRemoved", "kvfabric:c"),
        ("BlockStored", "kvfabric:a"),
    ]
    removed_hashes = {h for e in diff if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed_hashes == {h for e in before[1:] for h in e.block_hashes}  # type: ignore[attr-defined]
    assert inv.claims == 2 and inv.unannounced == 0
    # a copy without token ids that was never announced stays unannounced
    inv.resync([stored("a", 1, tokens=False)], {"a": 1})
    assert inv.unannounced == 1 and inv.claims == 0


def test_snapshot_events_name_every_claim_parents_first() -> None:
    inv = RemoteInventory("b", BLOCK, MEDIA, max_pending=2)
    inv.apply([stored("a", 2), stored("a", 1), stored("c", 0), stored("a", 0)])
    assert inv.take() is None  # more than max_pending piled up: the stream starts over
    snapshot = decoded(inv.snapshot_events())
    step = SPEC.chunk_tokens
    assert [e.token_ids[0] for e in snapshot] == [500, 500, 500 + step, 500 + 2 * step]  # type: ignore[attr-defined]
    assert {e.ownership for e in snapshot[:2]} == {"kvfabric:a", "kvfabric:c"}  # type: ignore[attr-defined]
    assert inv.take() == []  # the snapshot said it all


def test_a_namespace_of_partial_blocks_is_not_announced() -> None:
    inv = RemoteInventory("b", 24, MEDIA)  # 32-token chunks do not split into 24-token blocks
    inv.apply([stored("a", 0)])
    assert inv.take() == [] and inv.claims == 0
    assert REFS[0].parent == ROOT
