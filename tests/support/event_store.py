"""A small real store whose chunks carry token ids, for the KV event tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvfabric.hashing import chunk_hashes
from kvfabric.kvevents.announce import MEDIUM_OF_KIND
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
NS = Namespace("tiny", SPEC)
SALTED = Namespace("tiny", SPEC, tenant_salt="alice")
BLOCK = 16


def make_store(tmp_path: Path, dram_chunks: int = 8) -> TieredStore:
    tiers = (
        TierConfig(TierKind.DRAM, dram_chunks * SPEC.chunk_bytes, page_size=4096),
        TierConfig(TierKind.SSD, 64 * SPEC.chunk_bytes, path="ssd", segment_bytes=1 << 20),
    )
    return TieredStore(StoreConfig(data_dir=str(tmp_path), tiers=tiers), maintenance=False)


def media(store: TieredStore) -> dict[str, str]:
    return dict(zip(store.tier_names, (MEDIUM_OF_KIND[TierKind.DRAM], "STORAGE"), strict=True))


def put_prompt(store: TieredStore, ns: Namespace, tokens: list[int]) -> list[bytes]:
    refs = chunk_hashes(ns, tokens)
    start = 0
    for ref in refs:
        chunk = tokens[start : start + ref.num_tokens]
        start += ref.num_tokens
        data = np.zeros(SPEC.layout(ref.num_tokens).nbytes, dtype=np.uint8)
        store.put(ns, ref.key, data, parent=ref.parent, num_tokens=ref.num_tokens, tokens=chunk)
    return [r.key for r in refs]
