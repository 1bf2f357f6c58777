"""Cluster plane: the global index (embedded or Redis) and its KV event stream.

See :mod:`kvfabric.cluster.index` for the contract every backend keeps. The Redis backend is
imported lazily (``kvfabric.cluster.redis_index``) so that redis-py stays optional.
"""

from kvfabric.cluster.embedded import EmbeddedIndex, EmbeddedState
from kvfabric.cluster.index import (
    ChunkRecord,
    GlobalIndex,
    GlobalLookup,
    IndexSnapshot,
    KVEvent,
    Location,
    NodeInfo,
    NodePrefix,
)

__all__ = [
    "ChunkRecord",
    "EmbeddedIndex",
    "EmbeddedState",
    "GlobalIndex",
    "GlobalLookup",
    "IndexSnapshot",
    "KVEvent",
    "Location",
    "NodeInfo",
    "NodePrefix",
]
