"""Tensor parallelism through a real daemon: R producer ranks (separate clients, as separate
TP workers would be) each write their KV-head range of the same chunks; S consumer ranks read
theirs. Every split gives back exactly what a single-rank write stores."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.errors import AlreadyExistsError, ProtocolError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=3, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=16)
SPLITS = [1, 2, 4]


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("tp", "store.tiers.dram.capacity=16MiB")


def chain(tenant: str) -> tuple[Namespace, list, list[np.ndarray]]:
    ns = Namespace("tp-model", SPEC, tenant_salt=tenant)
    refs = chunk_hashes(ns, list(range(3 * SPEC.chunk_tokens - 5)))  # last chunk partial
    rng = np.random.default_rng(len(tenant))
    data = [
        rng.integers(0, 256, SPEC.layout(r.num_tokens).nbytes, dtype=np.uint8).reshape(
            SPEC.num_layers, 2, SPEC.num_kv_heads, -1
        )
        for r in refs
    ]
    return ns, refs, data


def head_ranges(parts: int) -> list[tuple[int, int]]:
    step = SPEC.num_kv_heads // parts
    return [(i * step, (i + 1) * step) for i in range(parts)]


@pytest.mark.parametrize("producers", SPLITS)
@pytest.mark.parametrize("consumers", SPLITS)
def test_every_tp_split_matches_a_single_rank_write(daemon, producers: int, consumers: int) -> None:
    ns, refs, data = chain(f"split-{producers}-{consumers}")
    single_ns, _, _ = chain(f"single-{producers}-{consumers}")
    single_refs = chunk_hashes(single_ns, list(range(3 * SPEC.chunk_tokens - 5)))
    with Client(daemon.socket) as one:  # the reference: one rank writes everything
        one.put_many(single_ns, single_refs, [d.reshape(-1) for d in data])
    ranks = [Client(daemon.socket) for _ in range(producers)]
    try:
        writers = [
            rank.reserve_many(ns, refs, heads=h) for rank, h in zip(ranks, head_ranges(producers))
        ]
        for layer in range(SPEC.num_layers):  # ranks interleave, as they would in a step
            for rank, rank_writers, (start, end) in zip(ranks, writers, head_ranges(producers)):
                for writer, chunk in zip(rank_writers, data):
                    writer.write_layer(layer, np.ascontiguousarray(chunk[layer, :, start:end]))
                rank.commit_layer_many(rank_writers, layer)
    finally:
        for rank in ranks:
            rank.close()
    with Client(daemon.socket) as reader:
        readers = reader.get_many(ns, [r.key for r in refs])
        reference = reader.get_many(single_ns, [r.key for r in single_refs])
        for got, want in zip(readers, reference):
            assert got is not None and got.complete and got.to_bytes() == want.to_bytes()
            for start, end in head_ranges(consumers):
                for layer in range(SPEC.num_layers):
                    mine = np.concatenate(got.layer_pieces(layer, heads=(start, end)))
                    theirs = np.concatenate(want.layer_pieces(layer, heads=(start, end)))
                    assert np.array_equal(mine, theirs)
        reader.release_many(readers + reference)


def test_bad_head_ranges_are_refused_and_leave_the_daemon_serving(daemon) -> None:
    ns, refs, _ = chain("bad")
    with Client(daemon.socket) as client:
        for heads in [(2, 2), (3, 5), (-1, 2)]:
            with pytest.raises(ProtocolError, match="heads|start|end"):
                client.reserve(ns, refs[0].key, parent=refs[0].parent, heads=heads)
        writer = client.reserve(ns, refs[0].key, parent=refs[0].parent, heads=(0, 2))
        with pytest.raises(AlreadyExistsError):
            client.reserve(ns, refs[0].key, parent=refs[0].parent, heads=(1, 4))
        writer.abort()
        assert client.lookup(ns, keys=[refs[0].key]).matched_chunks == 0
        client.ping()
