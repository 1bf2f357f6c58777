"""Global index backends (embedded, Redis, Redis Cluster) on real servers."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from redis_servers import RedisClusterServers

from kvfabric.cluster import EmbeddedIndex, EmbeddedState, GlobalIndex
from kvfabric.cluster.redis_index import RedisGlobalIndex


@pytest.fixture(scope="session")
def shared_redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """One 3-master Redis Cluster for the session; tests isolate themselves with a prefix."""
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.kill()


IndexFactory = Callable[..., GlobalIndex]


@pytest.fixture(params=["embedded", "redis", "redis-cluster"])
def make_index(request: pytest.FixtureRequest) -> Iterator[IndexFactory]:
    """make_index(lease_ttl=10.0, **options) -> a node's index on one shared backend.

    Every index a test makes sees the same state (one EmbeddedState / one Redis prefix on one
    server or one 3-master Redis Cluster), like several daemons sharing a cluster. The lease
    TTL is per backend state: the first call's value applies to embedded indexes.
    """
    made: list[GlobalIndex] = []
    state: list[EmbeddedState] = []
    prefix = f"t{uuid.uuid4().hex[:8]}"
    fixture = {"redis": "shared_redis", "redis-cluster": "shared_redis_cluster"}.get(request.param)
    server = None if fixture is None else request.getfixturevalue(fixture)

    def make(lease_ttl: float = 10.0, **options: object) -> GlobalIndex:
        index: GlobalIndex
        if server is None:
            if not state:
                state.append(EmbeddedState(lease_ttl=lease_ttl))
            index = EmbeddedIndex(state[0], **options)  # type: ignore[arg-type]
        else:
            index = RedisGlobalIndex(server.url, prefix=prefix, lease_ttl=lease_ttl, **options)  # type: ignore[arg-type]
        made.append(index)
        return index

    make.backend = request.param  # type: ignore[attr-defined]
    yield make
    for index in made:
        index.close()
