"""The index traffic :mod:`kvfabric.planning.opcosts` times: nodes, chains and publish runs.

Who calls: :func:`kvfabric.planning.opcosts.measure_opcosts` (and
:mod:`kvfabric.planning.opcosts_events`, for the tier the chunks are in). What a node
publishes is built as kvfabric builds it: node ids of a fixed length, chains of full chunks
hashed by :func:`kvfabric.hashing.chunk_hashes` with their token ids (seeded random tokens,
the same for the same seed), published through :class:`RedisGlobalIndex` one run per flush.
Sizes are in chunks; token ids are little-endian int32. Errors: the index's own propagate
(a Redis error; :meth:`RedisGlobalIndex.flush`'s ``DeadlineExceededError`` or
``UnavailableError``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvfabric.cluster.index import ChunkRecord
from kvfabric.cluster.redis_index import RedisGlobalIndex
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import Namespace

TIER = "dram"


def node_id(tag: str, i: int, chars: int) -> str:
    """A node id of exactly ``chars`` characters (ids' length is part of every owner entry,
    live field and event)."""
    return f"{tag}-{i:0{chars - len(tag) - 1}d}"


def make_chains(ns: Namespace, count: int, chain_chunks: int, seed: int) -> list[list[ChunkRecord]]:
    """``count`` chains of full chunks with their token ids, as a node publishes them."""
    ct = ns.spec.chunk_tokens
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, 128_000, size=chain_chunks * ct, dtype="<i4")
        refs = chunk_hashes(ns, tokens)
        out.append(
            [
                ChunkRecord(
                    ns.seed,
                    ref.key,
                    TIER,
                    ref.parent,
                    ref.num_tokens,
                    tokens[i * ct : (i + 1) * ct].tobytes(),
                    ct,
                )
                for i, ref in enumerate(refs)
            ]
        )
    return out


def publish_runs(
    index: RedisGlobalIndex,
    chains: Sequence[list[ChunkRecord]],
    run_chunks: int,
    *,
    removed: bool,
) -> int:
    """Publish every chain, one run of ``run_chunks`` per flush (one batch); the batches."""
    batches = 0
    for chain in chains:
        for i in range(0, len(chain), run_chunks):
            run = chain[i : i + run_chunks]
            if removed:
                index.publish(removed=run)
            else:
                index.publish(stored=run)
            index.flush(timeout=30.0)
            batches += 1
    return batches
