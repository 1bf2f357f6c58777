"""What a lookup counts (issue 12): a missed partial last chunk by its real tokens when the
caller says how many the keys cover, and tokens another node holds past the local prefix as
peer hits, in the store's own counters (what ``kvfabric status`` prints) and its result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("lookup-counts", SPEC)
PROMPT = list(range(72))  # four full chunks and a partial one of 8 tokens


@pytest.fixture
def store(tmp_path: Path):
    config = StoreConfig(
        data_dir=str(tmp_path),
        tiers=(TierConfig(TierKind.DRAM, 64 * SPEC.chunk_bytes, page_size=SPEC.chunk_bytes),),
    )
    s = TieredStore(config, maintenance=False)
    yield s
    s.close()


def counted(store: TieredStore) -> tuple[int, int, int, int]:
    stats = store.stats()
    return stats.lookup_tokens, stats.hit_tokens, stats.miss_tokens, stats.peer_hit_tokens


def test_a_missed_partial_chunk_counts_its_real_tokens(store: TieredStore) -> None:
    """Regression: on the old code five missed keys of a 72-token prompt counted 80."""
    keys = [ref.key for ref in chunk_hashes(NS, PROMPT)]
    result = store.lookup(NS, keys, num_tokens=72)
    assert (result.requested_tokens, result.miss_tokens) == (72, 72)
    assert counted(store) == (72, 0, 72, 0)
    assert store.lookup(NS, keys).requested_tokens == 80  # not told: full chunks


def test_tokens_another_node_holds_are_peer_hits_not_misses(store: TieredStore) -> None:
    """Regression: on the old code a decode node's lookup of a prompt only a peer held
    counted every token as a miss."""
    refs = chunk_hashes(NS, PROMPT)
    keys = [ref.key for ref in refs]
    for ref in refs[:2]:  # this node holds the first two chunks
        store.put(NS, ref.key, np.zeros(SPEC.chunk_bytes, np.uint8), parent=ref.parent)
    whole = store.lookup(NS, keys, num_tokens=72, peer_chunks=5)  # a peer holds it all
    assert (whole.matched_tokens, whole.peer_tokens, whole.miss_tokens) == (32, 40, 0)
    assert whole.tier_tokens == {"dram": 32}  # what this node holds, as before
    part = store.lookup(NS, keys, num_tokens=72, peer_chunks=3)  # a peer holds one more
    assert (part.matched_tokens, part.peer_tokens, part.miss_tokens) == (32, 16, 24)
    shorter = store.lookup(NS, keys, num_tokens=72, peer_chunks=1)  # less than held here
    assert (shorter.peer_tokens, shorter.miss_tokens) == (0, 40)
    assert counted(store) == (3 * 72, 3 * 32 + 40 + 16, 0 + 24 + 40, 40 + 16)
    (ns_stats,) = store.stats().namespaces
    assert (ns_stats.lookup_tokens, ns_stats.hit_tokens) == (3 * 72, 3 * 32 + 40 + 16)
