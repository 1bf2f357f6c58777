"""Host memory tiers (DRAM, CXL): paged shared-memory arenas, one per pool.

The default pool's arena holds the objects of the admin and of namespaces whose tenant has
no memory of its own; :meth:`HostTier.add_pool` gives a tenant an arena of its own (a
separate memfd), so a client of that tenant can be handed its tenant's descriptors and never
another's. Arenas are sparse: an arena as large as the tier costs no memory until its pages
are written, and :meth:`HostTier.release_free_memory` gives the memory of free pages back
(the tier's capacity stays one budget for all its arenas; see :mod:`kvfabric.tiers.base`).

A CXL tier is the same arenas bound to a (CPU-less) NUMA node; without one it degrades to
plain memory with a warning (see :mod:`kvfabric.memory.numa`) and differs from DRAM only in
its place in the tier order.
"""

from __future__ import annotations

import numpy as np

from kvfabric.memory.arena import SharedArena
from kvfabric.tiers.base import PagedTier, Pool, TierKind, View


class HostTier(PagedTier):
    """DRAM or CXL memory that local processes can map (the arenas' memfds)."""

    def __init__(
        self,
        name: str,
        kind: TierKind,
        capacity_bytes: int,
        page_size: int,
        *,
        numa_node: int | None = None,
        prefault: bool = False,
    ) -> None:
        if kind not in (TierKind.DRAM, TierKind.CXL):
            raise ValueError(f"a host tier is dram or cxl, not {kind.value}")
        size = capacity_bytes - capacity_bytes % page_size
        self._numa_node = numa_node
        self.prefault = prefault  # the default arena only: tenants' arenas fill on demand
        self.arenas: dict[Pool, SharedArena] = {
            None: SharedArena.create(
                size, page_size, name=f"kvfabric-{name}", numa_node=numa_node, prefault=prefault
            )
        }
        super().__init__(name, kind, size, page_size)
        self._views: dict[Pool, View] = {None: self._view_of(self.arenas[None].array)}

    @property
    def arena(self) -> SharedArena:
        """The default pool's arena."""
        return self.arenas[None]

    def add_pool(self, tenant: str, capacity_bytes: int) -> None:
        super().add_pool(tenant, capacity_bytes)
        size = self._pools[tenant].num_pages * self.page_size
        try:
            arena = SharedArena.create(
                size, self.page_size, name=f"kvfabric-{self.name}-tenant", numa_node=self._numa_node
            )
        except BaseException:
            del self._pools[tenant]
            raise
        self.arenas[tenant] = arena
        self._views[tenant] = self._view_of(arena.array)

    def _view_of(self, flat: np.ndarray) -> View:
        page_size = self.page_size

        def view(page_id: int, start: int, end: int) -> np.ndarray:
            base = page_id * page_size
            return flat[base + start : base + end]

        return view

    def _viewer(self, pool: Pool) -> View:
        return self._views[pool]

    def release_free_memory(self, keep_bytes: int) -> int:
        if self.prefault:
            return 0  # asked to keep every page resident
        keep = keep_bytes // self.page_size
        released = 0
        for pool, pages in self._pools.items():
            cold = pages.take_cold(keep)
            if not len(cold):
                continue
            arena = self.arenas[pool]
            # one call per run of adjacent pages
            breaks = np.flatnonzero(np.diff(cold.astype(np.int64)) != 1) + 1
            for run in np.split(cold, breaks):
                arena.release(int(run[0]) * self.page_size, len(run) * self.page_size)
            released += len(cold) * self.page_size
        return released

    def close(self) -> None:
        self._views = {}
        for arena in self.arenas.values():
            arena.close()
