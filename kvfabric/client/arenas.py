"""The daemon's shared-memory tiers, mapped into this process from passed descriptors."""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric.errors import ProtocolError
from kvfabric.memory.arena import SharedArena
from kvfabric.memory.pages import slice_pages


class ArenaSet:
    """Arenas by tier index, as announced in the hello reply (the fds arrive in that order)."""

    def __init__(self, announced: Sequence[dict[str, Any]], fds: Sequence[int]) -> None:
        if len(announced) != len(fds):
            for fd in fds:
                _close_quietly(fd)
            raise ProtocolError(f"daemon announced {len(announced)} arenas but passed "
                                f"{len(fds)} descriptors")
        self._arenas: dict[int, SharedArena] = {}
        try:
            for info, fd in zip(announced, fds):
                self._arenas[int(info["index"])] = SharedArena.attach(
                    fd, int(info["size"]), int(info["page_size"]))
        except BaseException:
            self.close()
            raise

    def viewer(self, tier: int, pages: array) -> "PageViewer":
        """A checked accessor for one object's pages (validated once, used per read)."""
        arena = self._arenas.get(tier)
        if arena is None:
            raise ProtocolError(f"object lives in tier {tier}, which this client cannot map")
        if pages and max(pages) >= arena.num_pages:
            raise ProtocolError("daemon named a page outside its arena")
        return PageViewer(arena.array, arena.page_size, pages)

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class PageViewer:
    """Zero-copy views of byte ranges of one object in a mapped arena.

    An object whose pages are one ascending run (what the daemon's allocator hands out while
    it can) is viewed as one stretch of the arena: a range is then one view, copied with one
    ``copyto``, instead of one view (and one copy call) per page.
    """

    def __init__(self, flat: np.ndarray, page_size: int, pages: array) -> None:
        self._flat, self._page_size, self._pages = flat, page_size, pages
        first = pages[0] if pages else 0
        run = array(pages.typecode, range(first, first + len(pages)))
        self._run_start = first * page_size if pages == run else None

    def pieces(self, offset: int, length: int) -> list[np.ndarray]:
        flat, ps, start = self._flat, self._page_size, self._run_start
        if start is None or offset < 0 or length <= 0 or offset + length > len(self._pages) * ps:
            return slice_pages(lambda p, s, e: flat[p * ps + s:p * ps + e], self._pages, ps,
                               offset, length)  # and its errors for ranges outside the object
        return [flat[start + offset:start + offset + length]]
