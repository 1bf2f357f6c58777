"""A daemon on a node with reserved huge pages puts its memory tier on them (huge_pages:
auto), and clients in other processes map those arenas and move chunks through them."""

from __future__ import annotations

import numpy as np
from huge_pages import hugetlb_pages, reserved

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=64)
NS = Namespace("huge", SPEC)


def test_a_daemon_serves_chunks_from_reserved_huge_pages(start_daemon) -> None:
    with reserved(48):  # 96 MiB: room for the 64 MiB tier
        daemon = start_daemon("store.tiers.dram.capacity=64MiB", "store.tiers.dram.prefault=true")
        assert daemon.proc is not None
        assert hugetlb_pages(daemon.proc.pid) == 32  # the whole tier, prefaulted
        refs = chunk_hashes(NS, list(range(8 * SPEC.chunk_tokens)))
        rng = np.random.default_rng(0)
        data = [rng.integers(0, 256, SPEC.chunk_bytes, dtype=np.uint8) for _ in refs]
        with Client(daemon.socket) as client:
            assert all(client.put_many(NS, refs, data))
            readers = client.get_many(NS, [r.key for r in refs])
            assert [r.to_bytes() for r in readers] == [d.tobytes() for d in data]  # type: ignore[union-attr]
            client.release_many(readers)
        daemon.kill()
