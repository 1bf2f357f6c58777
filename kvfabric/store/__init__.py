"""The node-local tiered store: index, placement / eviction, leases."""

from kvfabric.store.config import StoreConfig, TierConfig, parse_size
from kvfabric.store.handles import ObjectReader, ObjectWriter
from kvfabric.store.stats import StoreStats, TierStats
from kvfabric.lookup import LookupResult
from kvfabric.store.store import TieredStore

__all__ = ["LookupResult", "ObjectReader", "ObjectWriter", "StoreConfig", "StoreStats",
           "TierConfig", "TierStats", "TieredStore", "parse_size"]
