"""Daemons of a test cluster: the ``--set`` items of a node on a shared redis-server index,
a chain of random chunks put on one node (what the pull, push and index tests move), and
the token ids a node keeps with its chunks.

Every node gets a small DRAM tier and SSD tier unless ``tiers`` says otherwise, the Redis
index at ``redis_url``, a 0.2 s heartbeat, a peer transport on a free port (``tcp.port=0``),
and ``extra`` last (a later item wins over an earlier one of the same key).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvfabric.client import Client
from kvfabric.client.requests import item_results
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.messages import Op, encode_namespace
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
    ``first_token``, each chunk put with its own) put through the daemon at ``socket``;
    returns (keys, payloads)."""
    step = ns.spec.chunk_tokens
    refs = chunk_hashes(ns, list(range(first_token, first_token + n_chunks * step)))
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, ns.spec.chunk_bytes, dtype=np.uint8).tobytes() for _ in refs]
    with Client(socket) as client:
        for i, (ref, data) in enumerate(zip(refs, payloads)):
            start = first_token + i * step
            assert client.put(
                ns, ref.key, data, parent=ref.parent, tokens=range(start, start + step)
            )
    return [r.key for r in refs], payloads


def chain_tokens(ns: Namespace, n_chunks: int, first_token: int = 0) -> list[bytes]:
    """The token ids (int32-LE) of each chunk :func:`put_random_chain` puts."""
    step = ns.spec.chunk_tokens
    prompt = np.arange(first_token, first_token + n_chunks * step, dtype="<i4")
    return [prompt[i * step : (i + 1) * step].tobytes() for i in range(n_chunks)]


def tokens_held(tcp_port: int, ns: Namespace, keys: Sequence[bytes]) -> list[bytes | None]:
    """The token ids the daemon at ``tcp_port`` (auth off) keeps with each chunk of ``keys``
    (None: none), as a peer's ``peer_pin`` reads them; the pins are given back."""
    with Client(("127.0.0.1", tcp_port)) as admin:
        items = admin._call(Op.PEER_PIN, {"ns": encode_namespace(ns), "keys": list(keys)})
        results = item_results(items)
        for result in results:
            assert not isinstance(result, Exception), result
        admin._call(Op.PEER_RELEASE, {"leases": [r["lease"] for r in results]})
    return [r.get("tokens") for r in results]
