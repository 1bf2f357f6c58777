"""Local index: key -> entry, with the chain structure that prefix-aware placement needs.

A chunk is useless without its parent, so the index tracks each entry's stored children and
only offers *candidates* to demote or evict: entries none of whose children share their
tier. In the last tier that means true leaves (no stored child at all), so a chain is always
shortened from its tail, and a lookup (which walks a chain from its root and stops at the
first miss) never reports a chunk whose parent is gone. In upper tiers it moves a chain's
tail down before its head, which more prompts share.

Per tier, candidates are kept in LRU order. An entry that becomes a candidate because its
last child left goes to the LRU end, so the rest of that chain follows it before a hot leaf
elsewhere does.

Not thread-safe: the store calls it under its lock. Entries are mutable records owned by the
index (``__slots__`` keep them small: the index budget is a few hundred bytes per object).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Union

from kvfabric.spec import Namespace

READY_ALL = -1  # ``Entry.ready`` once every layer is committed (a cached small int)

# Entry.flags bits
MOVING = 1  # being copied to another tier; not a victim, readers may wait
REMOVED = 2  # no longer in the index (deleted / evicted / aborted) but maybe still pinned
ABORTED = 4  # the writer gave up: readers waiting on a layer get an error


class Entry:
    """Index record of one stored object (chunk)."""

    __slots__ = ("key", "parent", "ns", "num_tokens", "tier", "handle", "ready", "pins",
                 "kids", "flags")

    def __init__(self, key: bytes, parent: bytes, ns: Namespace, num_tokens: int, tier: int,
                 handle: Any) -> None:
        self.key = key
        self.parent = parent
        self.ns = ns
        self.num_tokens = num_tokens
        self.tier = tier
        self.handle = handle  # page ids (paged tier) or a DiskExtent (SSD tier)
        self.ready = 0  # bitmask of committed layers; READY_ALL when complete
        self.pins = 0  # readers and the writer's reservation
        self.kids: Kids = None  # stored children: None, one Entry, or a list (branch points)
        self.flags = 0

    @property
    def complete(self) -> bool:
        return self.ready == READY_ALL

    @property
    def children(self) -> list["Entry"]:
        kids = self.kids
        return [] if kids is None else [kids] if isinstance(kids, Entry) else list(kids)

    def __repr__(self) -> str:
        return (f"Entry({self.key.hex()[:12]}, tier={self.tier}, tokens={self.num_tokens}, "
                f"ready={self.ready}, pins={self.pins}, children={len(self.children)})")


Kids = Union[None, Entry, list[Entry]]


def _add_kid(kids: Kids, child: Entry) -> Kids:
    if kids is None:
        return child
    if isinstance(kids, Entry):
        return [kids, child]
    kids.append(child)
    return kids


def _remove_kid(kids: Kids, child: Entry) -> Kids:
    if kids is child:
        return None
    if isinstance(kids, list):
        kids.remove(child)
        return kids[0] if len(kids) == 1 else kids
    return kids


class LocalIndex:
    """Key map plus per-tier LRU lists of demotion / eviction candidates."""

    def __init__(self, num_tiers: int) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._candidates: list[OrderedDict[bytes, None]] = [OrderedDict()
                                                            for _ in range(num_tiers)]
        # children stored while their parent is absent, so a parent that (re)appears knows them
        self._orphans: dict[bytes, Kids] = {}
        self._tier_counts = [0] * num_tiers
        self._last = num_tiers - 1

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def tier_count(self, tier: int) -> int:
        """Number of indexed entries that live in ``tier``."""
        return self._tier_counts[tier]

    def longest_prefix(self, ns: Namespace, keys: Sequence[bytes]) -> list[Entry]:
        """Entries of ``keys[0..n)`` for the largest ``n`` with every key present in ``ns``.

        ``ns`` must be the store's interned instance: membership is an identity check, so a
        key of another tenant's chain is a miss, never a hit.
        """
        get = self._entries.get
        out: list[Entry] = []
        append = out.append
        for key in keys:
            entry = get(key)
            if entry is None or entry.ns is not ns:
                break
            append(entry)
        return out

    def add(self, entry: Entry) -> None:
        key = entry.key
        if key in self._entries:
            raise KeyError(f"{key.hex()} already indexed")
        entry.kids = self._orphans.pop(key, None)
        self._entries[key] = entry
        self._tier_counts[entry.tier] += 1
        parent = self._entries.get(entry.parent)
        if parent is not None:
            parent.kids = _add_kid(parent.kids, entry)
            self._refresh(parent, front=False)
        else:
            self._orphans[entry.parent] = _add_kid(self._orphans.get(entry.parent), entry)
        self._refresh(entry, front=False)

    def remove(self, entry: Entry) -> None:
        key = entry.key
        if self._entries.get(key) is not entry:
            return
        del self._entries[key]
        self._tier_counts[entry.tier] -= 1
        self._candidates[entry.tier].pop(key, None)
        if entry.kids is not None:
            self._orphans[key] = entry.kids
            entry.kids = None
        parent = self._entries.get(entry.parent)
        if parent is not None:
            parent.kids = _remove_kid(parent.kids, entry)
            self._refresh(parent, front=True)
        else:
            left = _remove_kid(self._orphans.get(entry.parent), entry)
            if left is None:
                self._orphans.pop(entry.parent, None)
            else:
                self._orphans[entry.parent] = left

    def touch(self, entry: Entry) -> None:
        """Mark a candidate most recently used (others are ordered through their children)."""
        candidates = self._candidates[entry.tier]
        if entry.key in candidates:
            candidates.move_to_end(entry.key)

    def move(self, entry: Entry, tier: int, handle: Any) -> None:
        """Re-home an entry in another tier (demotion / promotion)."""
        indexed = self._entries.get(entry.key) is entry
        if indexed:
            self._candidates[entry.tier].pop(entry.key, None)
            self._tier_counts[entry.tier] -= 1
            self._tier_counts[tier] += 1
        entry.tier = tier
        entry.handle = handle
        if indexed:
            self._refresh(entry, front=False)
            parent = self._entries.get(entry.parent)
            if parent is not None:
                self._refresh(parent, front=True)

    def pick_victim(self, tier: int) -> Entry | None:
        """The least recently used candidate of ``tier`` that is complete, unpinned, still."""
        entries = self._entries
        for key in self._candidates[tier]:
            entry = entries[key]
            if entry.pins == 0 and entry.ready == READY_ALL and not entry.flags & MOVING:
                return entry
        return None

    def pick_victim_for_eviction(self, tier: int) -> Entry | None:
        """Like :meth:`pick_victim`, but only true leaves: removing it orphans nothing."""
        entries = self._entries
        for key in self._candidates[tier]:
            entry = entries[key]
            if entry.kids is None and entry.pins == 0 and entry.ready == READY_ALL and \
                    not entry.flags & MOVING:
                return entry
        return None

    def candidates(self, tier: int) -> list[bytes]:
        """Candidate keys of ``tier``, least recently used first (tests, introspection)."""
        return list(self._candidates[tier])

    def _refresh(self, entry: Entry, *, front: bool) -> None:
        """Put ``entry`` in or out of its tier's candidate list after a chain change.

        In the last tier only true leaves qualify (leaving it means eviction, and a chunk
        without its parent is useless). Above it, an entry qualifies once none of its children
        shares its tier: the chain's tail moves down first, and a chain spread over tiers in
        any order can always make progress.
        """
        tier = entry.tier
        kids = entry.kids
        if kids is None:
            eligible = True
        elif tier == self._last:
            eligible = False
        elif isinstance(kids, Entry):
            eligible = kids.tier != tier
        else:
            eligible = all(kid.tier != tier for kid in kids)
        candidates = self._candidates[tier]
        if not eligible:
            candidates.pop(entry.key, None)
        elif entry.key not in candidates:
            candidates[entry.key] = None
            if front:
                candidates.move_to_end(entry.key, last=False)
