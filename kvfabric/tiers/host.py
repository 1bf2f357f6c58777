"""Host memory tiers (DRAM, CXL): a paged shared-memory arena.

A CXL tier is the same arena bound to a (CPU-less) NUMA node; without one it degrades to
plain memory with a warning (see :mod:`kvfabric.memory.numa`) and differs from DRAM only in
its place in the tier order.
"""

from __future__ import annotations

import numpy as np

from kvfabric.memory.arena import SharedArena
from kvfabric.tiers.base import PagedTier, TierKind


class HostTier(PagedTier):
    """DRAM or CXL memory that local processes can map (the arena's memfd)."""

    def __init__(self, name: str, kind: TierKind, capacity_bytes: int, page_size: int, *,
                 numa_node: int | None = None, prefault: bool = False) -> None:
        if kind not in (TierKind.DRAM, TierKind.CXL):
            raise ValueError(f"a host tier is dram or cxl, not {kind.value}")
        size = capacity_bytes - capacity_bytes % page_size
        self.arena = SharedArena.create(size, page_size, name=f"kvfabric-{name}",
                                        numa_node=numa_node, prefault=prefault)
        super().__init__(name, kind, size, page_size)
        self._array = self.arena.array

    def _view(self, page_id: int, start: int, end: int) -> np.ndarray:
        base = page_id * self.page_size
        return self._array[base + start:base + end]

    def close(self) -> None:
        self._array = np.empty(0, dtype=np.uint8)
        self.arena.close()
