"""Requests answered on the daemon's event loop, and the ones that must wait, through a real
daemon: batches of reservations and pins whose items partly need the SSD tier (a demotion to
make room, a read back) come back complete, byte-exact and in request order."""

from __future__ import annotations

import numpy as np

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=32)
NS = Namespace("loop", SPEC, tenant_salt="t1")  # 64 KiB chunks
DRAM_CHUNKS = 32
SETTINGS = [
    f"store.tiers.dram.capacity={DRAM_CHUNKS * SPEC.chunk_bytes}",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
]
BATCH = 16  # small enough to be tried on the loop first
CHUNKS = 4 * DRAM_CHUNKS


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, SPEC.chunk_bytes, dtype=np.uint8
    )


def test_batches_that_partly_need_the_ssd_come_back_whole_and_in_order(start_daemon) -> None:
    daemon = start_daemon(*SETTINGS)
    # one-chunk prompts: every chunk is a leaf, so any unpinned one can make room
    refs = [chunk_hashes(NS, [i] * SPEC.chunk_tokens)[0] for i in range(CHUNKS)]
    with Client(daemon.socket) as client:
        # four times what DRAM holds: later reservations wait for demotions to the SSD
        for start in range(0, CHUNKS, BATCH):
            batch = refs[start : start + BATCH]
            assert client.put_many(NS, batch, [payload(r.key) for r in batch]) == [True] * BATCH
        tiers = [client.lookup(NS, keys=[r.key]).tier_tokens for r in refs]
        assert all(tiers) and any("ssd" in t for t in tiers) and any("dram" in t for t in tiers)
        # pins of chunks on both tiers, interleaved: the SSD ones are read back on a worker
        order = [refs[i].key for i in range(0, CHUNKS, CHUNKS // BATCH)][::-1]
        readers = client.get_many(NS, [*order, b"\x07" * 16])
        assert readers[-1] is None  # never stored
        assert [r.key for r in readers[:-1]] == order  # type: ignore[union-attr]
        for key, reader in zip(order, readers):
            assert reader is not None and reader.to_bytes() == payload(key).tobytes()
        client.release_many(readers)
        stats = client.stats()
        assert stats["tiers"][0]["demotions"] > 0 and stats["gets"] == BATCH
