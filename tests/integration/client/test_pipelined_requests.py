"""Requests pipelined on one session against a real daemon: replies reach whoever waits for
them, in any order; a batch put overlapping its copies stores exactly what a plain one does
and leaves nothing reserved when one of its groups fails."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.client.pipelined_put import PIPELINE_MIN_BYTES
from kvfabric.errors import NotFoundError, ProtocolError
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.messages import Op, encode_namespace
from kvfabric.spec import KVSpec, Namespace

# 1 MiB chunks: 24 of them make a batch the client pipelines
SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=128)
NS = Namespace("pipelined", SPEC)
CHUNKS = 24


def payloads(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, SPEC.chunk_bytes, dtype=np.uint8) for _ in range(n)]


@pytest.fixture
def daemon(start_daemon):
    return start_daemon("store.tiers.dram.capacity=64MiB", "store.tiers.dram.page_size=256KiB")


def test_the_batch_is_big_enough_to_be_pipelined() -> None:
    assert SPEC.chunk_bytes * CHUNKS >= PIPELINE_MIN_BYTES


def test_pipelined_put_stores_every_chunk_byte_exact(daemon) -> None:
    refs = chunk_hashes(NS, list(range(CHUNKS * SPEC.chunk_tokens)))
    data = payloads(CHUNKS, seed=1)
    with Client(daemon.socket) as client:
        assert client.put_many(NS, refs[:5], data[:5]) == [True] * 5
        # the first five are there already: False for them, True for the rest
        assert client.put_many(NS, refs, data) == [False] * 5 + [True] * (CHUNKS - 5)
        readers = client.get_many(NS, [r.key for r in refs])
        for reader, expected in zip(readers, data):
            assert reader is not None and reader.to_bytes() == expected.tobytes()
        client.release_many(readers)
        stats = client.stats()
        assert stats["objects"] == CHUNKS and stats["aborted_writes"] == 0


def test_a_failing_group_aborts_what_it_reserved_and_keeps_what_was_committed(daemon) -> None:
    refs = chunk_hashes(NS, list(range(CHUNKS * SPEC.chunk_tokens)))
    tokens: list = [None] * CHUNKS
    tokens[-1] = list(range(7, 7 + SPEC.chunk_tokens))  # do not hash to the key: refused
    with Client(daemon.socket) as client:
        with pytest.raises(ProtocolError):
            client.put_many(NS, refs, payloads(CHUNKS, seed=2), tokens=tokens)
        found = client.contains(NS, [r.key for r in refs])
        # the groups before the failing one were committed; the failing one's chunks were not
        assert found[0] and not found[-1]
        assert found == sorted(found, reverse=True)
        stats = client.stats()
        assert stats["objects"] == sum(found)
        assert stats["aborted_writes"] == CHUNKS - 1 - sum(found)
        # nothing stays reserved: the refused group can be stored now
        assert all(client.put_many(NS, refs[sum(found) :], payloads(CHUNKS - sum(found), 3)))


def test_replies_reach_their_request_in_any_order(daemon) -> None:
    refs = chunk_hashes(NS, list(range(2 * SPEC.chunk_tokens)))
    with Client(daemon.socket) as client:
        client.put_many(NS, refs[:1], payloads(1, seed=4))
        session = client._session()
        args = {"ns": encode_namespace(NS), "keys": [refs[0].key, refs[1].key]}
        first = session.send(Op.CONTAINS, args)
        missing = session.send(Op.GET, {"ns": args["ns"], "key": refs[1].key})
        failing = session.send(Op.GET, {"ns": args["ns"], "key": refs[1].key})
        last = session.send(Op.PING, {})
        failing.discard()  # its error is dropped when read, never raised
        assert last.result() == "pong"
        with pytest.raises(NotFoundError):
            missing.result()
        assert first.result() == [True, False]
        assert client.contains(NS, [refs[0].key]) == [True]  # the session goes on
