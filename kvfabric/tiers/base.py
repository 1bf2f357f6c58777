"""Tier interface: one level of the node's storage hierarchy.

Two shapes of tier exist, and the store treats them differently:

* :class:`PagedTier` (DRAM, CXL, device): byte-addressable memory cut into pages. The store
  :meth:`~PagedTier.allocate` s pages for an object, callers read and write
  :meth:`~PagedTier.pieces` (views into the pages, zero copy) and the store
  :meth:`~PagedTier.free` s them. Host tiers give numpy views into shared memory that other
  processes can map; the device tier gives torch tensors.
* the SSD tier (:class:`kvfabric.tiers.disk.DiskTier`): records written and read whole, by a
  background writer, into and out of paged memory.

Tiers hold no index and no policy; the store owns both and serialises calls into a tier
under its lock (tiers are not thread-safe unless they say so).

Pools: a paged tier's pages come from one or more **pools**, each with its own allocator
(and, in a host tier, its own shared-memory arena): the default pool (key ``None``) and one
per tenant that owns memory of its own (:meth:`PagedTier.add_pool`). Page ids are pool
relative, and the :class:`~kvfabric.memory.pages.Pages` an allocation returns carry their
pool (a plain ``array`` of ids is the default pool's). The tier's capacity is one
budget for all its pools together: a pool may be as large as the tier, but the pages in use
across pools never exceed the capacity.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable

from kvfabric.errors import CapacityError
from kvfabric.memory.copy import Piece
from kvfabric.memory.pages import PageAllocator, Pages, slice_pages

Pool = str | None  # a tenant that has memory of its own, or None: the default pool
View = Callable[[int, int, int], Piece]  # (page id, start, end) -> bytes [start, end) of it


class TierKind(str, enum.Enum):
    """Where bytes live; also the label used in stats and metrics."""

    DEVICE = "device"
    DRAM = "dram"
    CXL = "cxl"
    SSD = "ssd"


class PagedTier(ABC):
    """Paged, byte-addressable memory with an O(1)-per-page allocator per pool."""

    def __init__(self, name: str, kind: TierKind, capacity_bytes: int, page_size: int) -> None:
        self.name = name
        self.kind = kind
        self.page_size = page_size
        self._budget = capacity_bytes // page_size  # pages in use, all pools together
        self._used = 0
        self._pools: dict[Pool, PageAllocator] = {None: PageAllocator(self._budget, None)}

    @property
    def capacity_bytes(self) -> int:
        return self._budget * self.page_size

    @property
    def used_bytes(self) -> int:
        return self._used * self.page_size

    @property
    def free_bytes(self) -> int:
        return (self._budget - self._used) * self.page_size

    @property
    def pools(self) -> list[Pool]:
        return list(self._pools)

    def pool_of(self, tenant: str) -> Pool:
        """The pool a tenant's objects use: its own if it has one, else the default."""
        return tenant if tenant in self._pools else None

    def add_pool(self, tenant: str, capacity_bytes: int) -> None:
        """Give ``tenant`` a pool of its own of up to ``capacity_bytes`` (at most the tier's)."""
        if not tenant or tenant in self._pools:
            raise ValueError(f"tier {self.name} already has a pool for {tenant!r}")
        size = min(capacity_bytes, self.capacity_bytes) // self.page_size
        self._pools[tenant] = PageAllocator(max(1, size), tenant)

    def pool_can_fit(self, nbytes: int, pool: Pool) -> bool:
        """Whether ``pool`` alone has the pages (the tier's budget aside)."""
        return self.pages_for(nbytes) <= self._pools[pool].free_pages

    def pool_free_pages(self, pool: Pool) -> int:
        return self._pools[pool].free_pages

    def pool_bytes(self, pool: Pool) -> int:
        """How large ``pool`` is (a tenant's quota of this tier, or the tier)."""
        return self._pools[pool].num_pages * self.page_size

    def pool_used_bytes(self, pool: Pool) -> int:
        """Bytes of ``pool``'s pages in use."""
        return self._pools[pool].used_pages * self.page_size

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    def can_fit(self, nbytes: int, pool: Pool = None) -> bool:
        count = self.pages_for(nbytes)
        return count <= self._budget - self._used and count <= self._pools[pool].free_pages

    def allocate(self, nbytes: int, pool: Pool = None) -> Pages:
        """Pages of ``pool`` for ``nbytes``; :class:`CapacityError` (nothing taken) when they
        do not fit in the tier's budget or in the pool."""
        if nbytes > self.capacity_bytes:
            raise CapacityError(
                f"{nbytes} bytes exceed the {self.name} tier's capacity {self.capacity_bytes}"
            )
        count = self.pages_for(nbytes)
        if count > self._budget - self._used:
            raise CapacityError(f"need {count} pages, {self._budget - self._used} free")
        pages = self._pools[pool].alloc(count)
        self._used += count
        return pages

    def free(self, pages: array[int]) -> None:
        self._pools[_pool(pages)].free(pages)
        self._used -= len(pages)

    def pieces(self, pages: array[int], offset: int, length: int) -> list[Piece]:
        """Views covering bytes ``[offset, offset+length)`` of an object stored in ``pages``."""
        return slice_pages(self._viewer(_pool(pages)), pages, self.page_size, offset, length)

    @abstractmethod
    def _viewer(self, pool: Pool) -> View:
        """How to view bytes of one page of ``pool``."""

    def release_free_memory(self, keep_bytes: int) -> int:
        """Give the memory of free pages back to the OS, keeping up to ``keep_bytes`` per
        pool of the most recently freed (the next reused); returns the bytes given back.
        Default: the memory is not the OS's to take back (device pools)."""
        return 0

    def close(self) -> None:
        """Release the tier's memory. Default: nothing to release."""


def _pool(pages: array[int]) -> Pool:
    return pages.pool if isinstance(pages, Pages) else None
