"""Storage tiers: host memory (DRAM, CXL), device memory, and the SSD segment log."""

from kvfabric.tiers.base import PagedTier, TierKind

__all__ = ["PagedTier", "TierKind"]
