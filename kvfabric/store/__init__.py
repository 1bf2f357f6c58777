"""The node-local tiered store: index, placement / eviction, leases.

The names below load on first use (PEP 562), so that importing ``kvfabric.store.config``
(sizes, the config value: what the command line and the daemon config need) does not load
the store itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "StoreConfig": "kvfabric.store.config",
    "TierConfig": "kvfabric.store.config",
    "parse_size": "kvfabric.store.config",
    "ObjectReader": "kvfabric.store.handles",
    "ObjectWriter": "kvfabric.store.handles",
    "StoreStats": "kvfabric.store.stats",
    "TierStats": "kvfabric.store.stats",
    "LookupResult": "kvfabric.lookup",
    "TieredStore": "kvfabric.store.store",
}

__all__ = [
    "LookupResult",
    "ObjectReader",
    "ObjectWriter",
    "StoreConfig",
    "StoreStats",
    "TierConfig",
    "TierStats",
    "TieredStore",
    "parse_size",
]

if TYPE_CHECKING:
    from kvfabric.lookup import LookupResult
    from kvfabric.store.config import StoreConfig, TierConfig, parse_size
    from kvfabric.store.handles import ObjectReader, ObjectWriter
    from kvfabric.store.stats import StoreStats, TierStats
    from kvfabric.store.store import TieredStore


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfabric.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
