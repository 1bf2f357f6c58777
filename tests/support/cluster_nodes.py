"""Daemons of a test cluster: the ``--set`` items of a node on a shared redis-server index,
and a chain of random chunks put on one node (what the pull, push and index tests move).

Every node gets a small DRAM tier and SSD tier unless ``tiers`` says otherwise, the Redis
index at ``redis_url``, a 0.2 s heartbeat, a peer transport on a free port (``tcp.port=0``),
and ``extra`` last (a later item wins over an earlier one of the same key).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import Namespace

SMALL_TIERS = (
    "store.tiers.dram.capacity=4MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=32MiB",
)


def cluster_node(
    redis_url: str,
    node_id: str,
    *extra: str,
    transport: str | None = None,
    lease_ttl_s: float | None = 10,
    tiers: Sequence[str] = SMALL_TIERS,
) -> list[str]:
    """A node's settings; ``transport``/``lease_ttl_s`` None: the daemon's default."""
    return [
        *tiers,
        f"node_id={node_id}",
        "cluster.index=redis",
        f"cluster.redis_url={redis_url}",
        *([] if lease_ttl_s is None else [f"cluster.lease_ttl_s={lease_ttl_s}"]),
        "cluster.heartbeat_s=0.2",
        "tcp.port=0",
        *([] if transport is None else [f"cluster.transport={transport}"]),
        *extra,
    ]


def put_random_chain(
    socket: str, ns: Namespace, n_chunks: int, seed: int = 7, first_token: int = 0
) -> tuple[list[bytes], list[bytes]]:
    """A chain of ``n_chunks`` random chunks (the prompt: consecutive token ids from
    ``first_token``) put through the daemon at ``socket``; returns (keys, payloads)."""
    tokens = range(first_token, first_token + n_chunks * ns.spec.chunk_tokens)
    refs = chunk_hashes(ns, list(tokens))
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, ns.spec.chunk_bytes, dtype=np.uint8).tobytes() for _ in refs]
    with Client(socket) as client:
        for ref, data in zip(refs, payloads):
            assert client.put(ns, ref.key, data, parent=ref.parent)
    return [r.key for r in refs], payloads
