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

import logging
import math

import numpy as np

from kvfabric.errors import CapacityError
from kvfabric.memory import pagesize
from kvfabric.memory.arena import SharedArena
from kvfabric.tiers.base import PagedTier, Pool, TierKind, View

log = logging.getLogger(__name__)


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
        huge_pages: str = "off",
    ) -> None:
        if kind not in (TierKind.DRAM, TierKind.CXL):
            raise ValueError(f"a host tier is dram or cxl, not {kind.value}")
        self._numa_node = numa_node
        self._huge_pages = huge_pages
        self.prefault = prefault  # the default arena only: tenants' arenas fill on demand
        arena = self._new_arena(capacity_bytes, page_size, f"kvfabric-{name}", prefault=prefault)
        self.arenas: dict[Pool, SharedArena] = {None: arena}
        super().__init__(name, kind, arena.size, page_size)
        self._views: dict[Pool, View] = {None: self._view_of(self.arenas[None].array)}

    @property
    def arena(self) -> SharedArena:
        """The default pool's arena."""
        return self.arenas[None]

    def add_pool(self, tenant: str, capacity_bytes: int) -> None:
        super().add_pool(tenant, capacity_bytes)
        size = self._pools[tenant].num_pages * self.page_size
        try:
            name = f"kvfabric-{self.name}-tenant"
            arena = self._new_arena(size, self.page_size, name, exact=True)
        except BaseException:
            del self._pools[tenant]
            raise
        self.arenas[tenant] = arena
        self._views[tenant] = self._view_of(arena.array)

    def _new_arena(
        self,
        capacity: int,
        page_size: int,
        name: str,
        *,
        prefault: bool = False,
        exact: bool = False,
    ) -> SharedArena:
        """An arena of at most ``capacity`` bytes (``exact``: of ``capacity`` bytes, a
        multiple of ``page_size``), on reserved huge pages as ``huge_pages`` says: a hugetlb
        arena is a whole number of huge pages and of ``page_size``s."""
        size = capacity - capacity % page_size
        if self._huge_pages != "off":
            huge = pagesize.hugetlb_page_bytes()
            unit = math.lcm(page_size, huge) if huge else 0
            fits = unit and capacity >= unit and not (exact and capacity % unit)
            wanted = capacity - capacity % unit if unit else 0
            if fits and (self._huge_pages == "on" or pagesize.hugetlb_free_bytes() >= wanted):
                try:
                    return SharedArena.create(
                        wanted,
                        page_size,
                        name=name,
                        numa_node=self._numa_node,
                        prefault=prefault,
                        hugetlb=True,
                    )
                except OSError as exc:
                    if self._huge_pages == "on":
                        raise CapacityError(_no_huge_pages(capacity, exc)) from None
                    log.info("%s: reserved huge pages ran short (%s); plain pages", name, exc)
            elif self._huge_pages == "on":
                raise CapacityError(_no_huge_pages(capacity, None))
        return SharedArena.create(
            size, page_size, name=name, numa_node=self._numa_node, prefault=prefault
        )

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


def _no_huge_pages(capacity: int, exc: OSError | None) -> str:
    huge = pagesize.hugetlb_page_bytes() or 2 << 20
    need = -(-capacity // huge)
    why = f" ({exc})" if exc is not None else ""
    return (
        f"huge_pages: on, but {capacity} bytes of reserved huge pages are not free{why}; "
        f"reserve them (sysctl vm.nr_hugepages={need} or more) or set huge_pages: auto"
    )
