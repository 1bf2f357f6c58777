"""The Redis index on a real 3-master Redis Cluster, with namespaces spread over every master.

The contract suite (test_index_contract.py) runs against the cluster too; this module checks
what only a cluster can break: a node's namespaces living on different masters (register's new
epoch, heartbeats, multi-namespace batches, the snapshot's scan), and the cluster URL.
"""

from __future__ import annotations

import uuid

import pytest
import redis
from redis.cluster import RedisCluster

from kvfabric.cluster import ChunkRecord, NodeInfo
from kvfabric.cluster.redis_index import RedisGlobalIndex
from kvfabric.errors import UnavailableError
from kvfabric.hashing import ROOT, chunk_keys
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)
SPACES = [Namespace("model-a", SPEC, tenant_salt=f"tenant-{i}") for i in range(12)]


def records(ns: Namespace, tier: str) -> list[ChunkRecord]:
    keys = chunk_keys(ns, list(range(12)))  # three chunks
    return [
        ChunkRecord(ns.seed, key, tier, keys[i - 1] if i else ROOT, 4) for i, key in enumerate(keys)
    ]


def register(index: RedisGlobalIndex, name: str) -> NodeInfo:
    return index.register(NodeInfo(name, "10.0.0.1:7000", ("dram",), "h200", {}))


@pytest.fixture
def cluster_index(shared_redis_cluster):
    prefix = f"c{uuid.uuid4().hex[:8]}"
    made: list[RedisGlobalIndex] = []

    def make(**options: object) -> RedisGlobalIndex:
        made.append(RedisGlobalIndex(shared_redis_cluster.url, prefix=prefix, **options))  # type: ignore[arg-type]
        return made[-1]

    make.prefix = prefix  # type: ignore[attr-defined]
    yield make
    for index in made:
        index.close()


def test_namespaces_on_every_master_restart_heartbeat_and_snapshot(
    cluster_index, shared_redis_cluster
) -> None:
    raw = RedisCluster.from_url(shared_redis_cluster.url.replace("redis+cluster", "redis"))
    old = cluster_index()
    register(old, "n1")
    for ns in SPACES:  # one batch over every namespace (one flush)
        old.publish(stored=records(ns, "dram"))
    old.flush()
    tags = [ns.seed.hex() for ns in SPACES] + ["reg"]
    masters = {raw.get_node_from_key(f"{cluster_index.prefix}:{{{tag}}}:live").name for tag in tags}
    raw.close()
    assert len(masters) == 3  # every master holds some (fixed seeds, slots split evenly)

    reader = cluster_index()
    for ns in SPACES:
        assert reader.lookup(ns.seed, [r.key for r in records(ns, "dram")]).matched_chunks == 3
    old.heartbeat()  # renews the leases of all twelve namespaces across the masters
    snap = reader.snapshot()
    assert len(snap.events) == 3 * len(SPACES)
    assert {ev.seed_hex for ev in snap.events} == {ns.seed.hex() for ns in SPACES}

    restarted = cluster_index()
    register(restarted, "n1")  # the new epoch reaches every namespace's live hash at once
    for ns in SPACES:
        assert reader.lookup(ns.seed, [r.key for r in records(ns, "dram")]).matched_chunks == 0
    assert reader.snapshot().events == ()
    restarted.publish(stored=records(SPACES[0], "ssd"))
    restarted.flush()
    assert [ev.tier for ev in reader.events(snap.stream_id, count=100)] == ["ssd"]


def test_unreachable_cluster_fails_fast() -> None:
    with pytest.raises(UnavailableError):
        RedisGlobalIndex("redis+cluster://127.0.0.1:1/0", socket_timeout=0.2)


def test_single_server_url_is_not_a_cluster_client(shared_redis) -> None:
    index = RedisGlobalIndex(shared_redis.url, prefix=f"s{uuid.uuid4().hex[:8]}")
    try:
        assert isinstance(index._r, redis.Redis)
    finally:
        index.close()
