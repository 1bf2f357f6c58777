"""The daemon's shared-memory arenas, mapped into this process from passed descriptors.

The hello reply announces the arenas this session may map (a tenant's session: its tenant's
only) and the descriptors arrive in that order. Placements name the arena their pages lie
in (``arena``; a daemon that does not name it has one arena per tier, keyed by tier index).

Each arena is mapped ``PROT_READ`` for readers' views, and a second, writable mapping is made
the first time a writer needs one: a stray write through a reader's view faults instead of
changing stored bytes. A session that asked for read-only access got ``O_RDONLY``
descriptors, so a writable mapping is refused by the OS as well as here.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric.errors import ForbiddenError, ProtocolError
from kvfabric.memory.arena import SharedArena
from kvfabric.memory.pages import slice_pages


class ArenaSet:
    """Arenas by arena id, as announced in the hello reply."""

    def __init__(self, announced: Sequence[dict[str, Any]], fds: Sequence[int]) -> None:
        if len(announced) != len(fds):
            for fd in fds:
                _close_quietly(fd)
            raise ProtocolError(
                f"daemon announced {len(announced)} arenas but passed {len(fds)} descriptors"
            )
        self._arenas: dict[int, SharedArena] = {}  # PROT_READ; each owns its descriptor
        self._writable: dict[int, SharedArena] = {}  # made on a writer's first use
        self._may_write: dict[int, bool] = {}
        try:
            for info, fd in zip(announced, fds):
                arena_id = int(info.get("arena", info["index"]))
                self._may_write[arena_id] = bool(info.get("writable", True))
                self._arenas[arena_id] = SharedArena.attach(
                    fd, int(info["size"]), int(info["page_size"]), writable=False
                )
        except BaseException:
            self.close()
            raise

    def viewer(self, arena_id: int, pages: array[int], *, write: bool = False) -> PageViewer:
        """A checked accessor for one object's pages (validated once, used per read);
        ``write``: through the writable mapping (a reservation's pages)."""
        arena = self._arenas.get(arena_id)
        if arena is None:
            raise ProtocolError(f"object lives in arena {arena_id}, which this client cannot map")
        if pages and max(pages) >= arena.num_pages:
            raise ProtocolError("daemon named a page outside its arena")
        if write:
            arena = self._writable_arena(arena_id, arena)
        return PageViewer(arena.array, arena.page_size, pages)

    def _writable_arena(self, arena_id: int, mapped: SharedArena) -> SharedArena:
        writable = self._writable.get(arena_id)
        if writable is not None:
            return writable
        if not self._may_write[arena_id]:
            raise ForbiddenError("this session's arenas are read-only")
        fd = os.dup(mapped.fd)
        try:
            writable = SharedArena.attach(fd, mapped.size, mapped.page_size, writable=True)
        except OSError as exc:
            _close_quietly(fd)
            raise ForbiddenError(f"cannot map arena {arena_id} writable: {exc}") from None
        self._writable[arena_id] = writable
        return writable

    def close(self) -> None:
        for arena in [*self._writable.values(), *self._arenas.values()]:
            arena.close()
        self._arenas.clear()
        self._writable.clear()


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

    def __init__(self, flat: np.ndarray, page_size: int, pages: array[int]) -> None:
        self._flat, self._page_size, self._pages = flat, page_size, pages
        first = pages[0] if pages else 0
        run = array(pages.typecode, range(first, first + len(pages)))
        self._run_start = first * page_size if pages == run else None

    def pieces(self, offset: int, length: int) -> list[np.ndarray]:
        flat, ps, start = self._flat, self._page_size, self._run_start
        if start is None or offset < 0 or length <= 0 or offset + length > len(self._pages) * ps:
            return slice_pages(
                lambda p, s, e: flat[p * ps + s : p * ps + e], self._pages, ps, offset, length
            )  # and its errors for ranges outside the object
        return [flat[start + offset : start + offset + length]]
