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
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from array import array

from kvfabric.errors import CapacityError
from kvfabric.memory.copy import Piece
from kvfabric.memory.pages import PageAllocator, slice_pages


class TierKind(str, enum.Enum):
    """Where bytes live; also the label used in stats and metrics."""

    DEVICE = "device"
    DRAM = "dram"
    CXL = "cxl"
    SSD = "ssd"


class PagedTier(ABC):
    """Paged, byte-addressable memory with an O(1)-per-page allocator."""

    def __init__(self, name: str, kind: TierKind, capacity_bytes: int, page_size: int) -> None:
        self.name = name
        self.kind = kind
        self.page_size = page_size
        self._pages = PageAllocator(capacity_bytes // page_size)

    @property
    def capacity_bytes(self) -> int:
        return self._pages.num_pages * self.page_size

    @property
    def used_bytes(self) -> int:
        return self._pages.used_pages * self.page_size

    @property
    def free_bytes(self) -> int:
        return self._pages.free_pages * self.page_size

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    def can_fit(self, nbytes: int) -> bool:
        return self.pages_for(nbytes) <= self._pages.free_pages

    def allocate(self, nbytes: int) -> array:
        """Pages for ``nbytes``; :class:`CapacityError` (nothing taken) when they do not fit."""
        if nbytes > self.capacity_bytes:
            raise CapacityError(f"{nbytes} bytes exceed the {self.name} tier's capacity "
                                f"{self.capacity_bytes}")
        return self._pages.alloc(self.pages_for(nbytes))

    def free(self, pages: array) -> None:
        self._pages.free(pages)

    def pieces(self, pages: array, offset: int, length: int) -> list[Piece]:
        """Views covering bytes ``[offset, offset+length)`` of an object stored in ``pages``."""
        return slice_pages(self._view, pages, self.page_size, offset, length)

    @abstractmethod
    def _view(self, page_id: int, start: int, end: int) -> Piece:
        """Bytes ``[start, end)`` of one page as a view."""

    def close(self) -> None:
        """Release the tier's memory. Default: nothing to release."""
