"""Fixed-size page allocator: the bookkeeping half of an arena (no memory of its own).

An object is a list of pages (scatter-gather), so there is no external fragmentation and
allocating ``n`` pages costs O(n) C-level work, O(1) per page. Freed pages go on top of a
stack; a fresh allocator hands out ascending, contiguous runs, which keeps copies local.

The allocator also remembers which free pages may still hold memory (every page handed out
may have been written): :meth:`PageAllocator.take_cold` names the free pages below the top
of the stack (the next to be reused) that do, so the owner can give their memory back to
the OS (``MADV_REMOVE``) and an emptied arena stops costing RSS. The free stack is an
``array`` of uint32 (4 bytes a page, not a list of Python ints).

Not thread-safe: the owner (a tier, under the store lock) serialises calls.
Double frees and foreign page ids raise ``ValueError`` before any state changes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.errors import CapacityError

PAGE_ID_TYPECODE = "I"  # uint32 page ids: 4 bytes each in an object's page list


if TYPE_CHECKING:
    _IntArray = array[int]
else:  # array.array takes no type arguments at run time (before Python 3.12)
    _IntArray = array


class Pages(_IntArray):
    """An object's page ids (uint32) and the pool they belong to: page ids are relative to
    one allocator (one arena), so the pages name it. An ``array`` in every other respect."""

    __slots__ = ("pool",)
    pool: Any  # the allocator's pool (see PageAllocator)


class PageAllocator:
    """Hands out page ids in ``[0, num_pages)``; never the same page twice, never loses one."""

    def __init__(self, num_pages: int, pool: Any = None) -> None:
        """``pool``: stamped on every :class:`Pages` this allocator hands out."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if num_pages >= 1 << 32:
            raise ValueError("at most 2**32 - 1 pages per arena")
        self._num_pages = num_pages
        self.pool = pool
        self._free = array(PAGE_ID_TYPECODE, range(num_pages - 1, -1, -1))  # top = lowest id
        self._in_use = np.zeros(num_pages, dtype=np.bool_)
        self._resident = np.zeros(num_pages, dtype=np.bool_)  # handed out since last released
        self._freed = False  # pages were freed since the last take_cold

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self._num_pages - len(self._free)

    def alloc(self, count: int) -> Pages:
        """``count`` distinct free pages, or :class:`CapacityError` with nothing taken."""
        if count < 0:
            raise ValueError(f"page count must be >= 0, got {count}")
        if count > len(self._free):
            raise CapacityError(f"need {count} pages, {len(self._free)} free")
        pages = Pages(PAGE_ID_TYPECODE)
        pages.pool = self.pool
        if not count:
            return pages  # (a slice [-0:] would be every free page)
        taken = self._free[-count:]  # a copy
        del self._free[-count:]
        taken.reverse()
        pages.extend(taken)
        ids = np.frombuffer(pages, dtype=np.uint32)
        self._in_use[ids] = True
        self._resident[ids] = True
        del ids  # the view pins the array's buffer
        return pages

    def free(self, pages: array[int]) -> None:
        """Return pages; raises ``ValueError`` on a foreign id or a page that is not in use."""
        if not len(pages):
            return
        ids = (
            np.frombuffer(pages, dtype=np.uint32)
            if isinstance(pages, array)
            else np.asarray(pages, dtype=np.int64)
        )
        if ids.min() < 0 or ids.max() >= self._num_pages:
            raise ValueError("page id out of range")
        if not self._in_use[ids].all() or len(np.unique(ids)) != len(ids):
            raise ValueError("double free: a page is not allocated (or listed twice)")
        self._in_use[ids] = False
        self._free.frombytes(ids[::-1].astype(np.uint32).tobytes())
        self._freed = True

    def take_cold(self, keep: int) -> np.ndarray:
        """Free pages that may hold memory, except the ``keep`` on top of the stack (the next
        ones :meth:`alloc` hands out): sorted ids, marked released. The caller gives their
        memory back to the OS."""
        cold = max(0, len(self._free) - max(0, keep))
        if not self._freed and keep > 0:  # nothing new can lie below the top since last time
            return np.empty(0, dtype=np.uint32)
        self._freed = False
        if not cold:
            return np.empty(0, dtype=np.uint32)
        below = np.frombuffer(self._free[:cold], dtype=np.uint32)  # a copy's buffer
        ids = np.sort(below[self._resident[below]])
        self._resident[ids] = False
        return ids


def slice_pages(
    view: Callable[[int, int, int], Any],
    pages: Sequence[int],
    page_size: int,
    offset: int,
    length: int,
) -> list[Any]:
    """Pieces covering bytes ``[offset, offset+length)`` of an object stored in ``pages``.

    ``view(page_id, start, end)`` returns bytes ``[start, end)`` of one page; the tiers and the
    clients (which map the same arena from another process) share this arithmetic.
    """
    if offset < 0 or length < 0 or offset + length > len(pages) * page_size:
        raise ValueError(f"byte range [{offset}, {offset + length}) outside the object")
    if not length:
        return []
    first, start = divmod(offset, page_size)
    last, end = divmod(offset + length - 1, page_size)
    if first == last:
        return [view(pages[first], start, end + 1)]
    # whole pages in between without per-page arithmetic: a 32 MiB object has 128 pieces
    return [
        view(pages[first], start, page_size),
        *[view(page, 0, page_size) for page in pages[first + 1 : last]],
        view(pages[last], 0, end + 1),
    ]
