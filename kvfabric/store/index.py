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

Lookups (:meth:`LocalIndex.prefix_counts`) are on every request's path, so they do not walk
entries attribute by attribute in Python: a side map gives each key a :class:`LookupTag`
(namespace, tier, tokens) shared by every full chunk of one namespace in one tier, so a
chain's tags are fetched and grouped into runs in C and only each run is looked at here.

Tenants whose memory is bounded (a quota) also get candidate lists of their own per tier
(:meth:`LocalIndex.track_tenant`), so a tenant at its quota makes room among its own objects
without walking everyone else's. And the index counts entries per namespace: when a
namespace's last entry leaves, ``on_namespace_empty`` is called (the store forgets the
namespace, so namespaces that hold nothing cost no table slot).

Not thread-safe: the store calls it under its lock. Entries are mutable records owned by the
index (``__slots__`` keep them small: the index budget is a few hundred bytes per object).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import groupby
from typing import Any

from kvfabric.spec import Namespace

READY_ALL = -1  # ``Entry.ready`` once every layer is committed (a cached small int)

# Entry.flags bits
MOVING = 1  # being copied to another tier; not a victim, readers may wait
REMOVED = 2  # no longer in the index (deleted / evicted / aborted) but maybe still pinned
ABORTED = 4  # the writer gave up: readers waiting on a layer get an error
FP8_ON_DISK = 8  # its SSD copy is in fp8 (store/codec.py): decode when reading it back
FP8_COPY = 16  # the SSD record a memory-resident entry keeps (``ssd_copy``) is in fp8


class Entry:
    """Index record of one stored object (chunk)."""

    __slots__ = (
        "flags",
        "handle",
        "key",
        "kids",
        "ns",
        "num_tokens",
        "parent",
        "pins",
        "ready",
        "shards",
        "ssd_copy",
        "tier",
        "tokens",
    )

    def __init__(
        self,
        key: bytes,
        parent: bytes,
        ns: Namespace,
        num_tokens: int,
        tier: int,
        handle: Any,
        tokens: bytes | None = None,
    ) -> None:
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
        # HeadShards while tensor-parallel ranks write head ranges: set before the entry is
        # indexed, only ever cleared after (lookup tags rely on it)
        self.shards: Any = None
        # the SSD record (a DiskExtent) a memory-resident entry was promoted from: kept until
        # the SSD needs the space, so a crash still finds the object and demoting it again
        # writes nothing (see store/placement.py)
        self.ssd_copy: Any = None
        # the chunk's own token ids (int32-LE, checked against the key) when its writer gave
        # them; None costs no object of its own (the per-object budget above)
        self.tokens = tokens

    @property
    def complete(self) -> bool:
        return self.ready == READY_ALL

    @property
    def children(self) -> list[Entry]:
        kids = self.kids
        return [] if kids is None else [kids] if isinstance(kids, Entry) else list(kids)

    def __repr__(self) -> str:
        return (
            f"Entry({self.key.hex()[:12]}, tier={self.tier}, tokens={self.num_tokens}, "
            f"ready={self.ready}, pins={self.pins}, children={len(self.children)})"
        )


Kids = Entry | list[Entry] | None


class LookupTag:
    """What a lookup counts of an entry: its namespace, tier and tokens.

    Entries holding a full chunk of one namespace in one tier share one instance, so equal
    tags are the same object and a run of them compares by identity.
    """

    __slots__ = ("ns", "num_tokens", "tier")

    def __init__(self, ns: Namespace, tier: int, num_tokens: int) -> None:
        self.ns, self.tier, self.num_tokens = ns, tier, num_tokens


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
    """Key map plus per-tier LRU lists of demotion / eviction candidates.

    Entries are found by (namespace, key). Keys of different namespaces differ by
    construction (the namespace seed is hashed into every key), so the map is keyed by the
    key alone; a key that a *second* namespace uses on purpose (a tenant replaying another
    tenant's keys) goes to a small side map, so it can neither see, block nor replace the
    first namespace's object.
    """

    def __init__(
        self, num_tiers: int, on_namespace_empty: Callable[[Namespace], None] | None = None
    ) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._shadow: dict[tuple[bytes, bytes], Entry] = {}  # (ns seed, key) on collisions
        self._candidates: list[OrderedDict[Entry, None]] = [OrderedDict() for _ in range(num_tiers)]
        # children stored while their parent is absent, so a parent that (re)appears knows them
        self._orphans: dict[tuple[bytes, bytes], Kids] = {}
        self._tier_counts = [0] * num_tiers
        self._last = num_tiers - 1
        # key -> tag of its entry in ``_entries`` (not the side map); None while the object
        # is written by head ranges, or was until a lookup finds it complete and re-tags it
        # (the store clears ``Entry.shards`` when the last range lands, without telling us)
        self._tags: dict[bytes, LookupTag | None] = {}
        # the shared full-chunk tags, by (namespace seed, tier): at most namespaces x tiers
        self._shared_tags: dict[tuple[bytes, int], LookupTag] = {}
        # candidates of tracked tenants, by (tenant, tier), in the same LRU order
        self._tracked: set[str] = set()
        self._by_tenant: dict[tuple[str, int], OrderedDict[Entry, None]] = {}
        self._ns_entries: dict[bytes, int] = {}  # namespace seed -> indexed entries
        self._on_namespace_empty = on_namespace_empty
        self._peak = 0  # most entries held since the tables were last rebuilt

    def track_tenant(self, tenant: str) -> None:
        """Keep candidate lists of ``tenant``'s own (for :meth:`pick_victim` by tenant).
        Call before the tenant's first entry is added."""
        self._tracked.add(tenant)

    def namespace_entries(self, ns: Namespace) -> int:
        return self._ns_entries.get(ns.seed, 0)

    def compact(self) -> bool:
        """Rebuild the key tables once they hold under a quarter of their peak: a dict
        never shrinks by deletion, so after an evict-all it would keep its peak size."""
        if len(self) * 4 >= self._peak or self._peak < 1024:
            return False
        self._entries = dict(self._entries)
        self._tags = dict(self._tags)
        self._shadow = dict(self._shadow)
        self._orphans = dict(self._orphans)
        self._candidates = [OrderedDict(c) for c in self._candidates]
        self._by_tenant = {k: OrderedDict(c) for k, c in self._by_tenant.items() if c}
        self._peak = len(self)
        return True

    def _candidate_put(self, entry: Entry, front: bool) -> None:
        candidates = self._candidates[entry.tier]
        candidates[entry] = None
        if front:
            candidates.move_to_end(entry, last=False)
        if self._tracked and entry.ns.tenant_salt in self._tracked:
            own = self._by_tenant.setdefault((entry.ns.tenant_salt, entry.tier), OrderedDict())
            own[entry] = None
            if front:
                own.move_to_end(entry, last=False)

    def _candidate_drop(self, entry: Entry, tier: int) -> None:
        self._candidates[tier].pop(entry, None)
        if self._tracked:
            own = self._by_tenant.get((entry.ns.tenant_salt, tier))
            if own is not None:
                own.pop(entry, None)

    def __len__(self) -> int:
        return len(self._entries) + len(self._shadow)

    def find(self, ns: Namespace, key: bytes) -> Entry | None:
        """The entry of ``key`` in ``ns`` (the store's interned namespace instance)."""
        entry = self._entries.get(key)
        if entry is not None and entry.ns is ns:
            return entry
        return self._shadow.get((ns.seed, key)) if self._shadow else None

    def any_with_key(self, key: bytes) -> list[Entry]:
        """Every entry stored under ``key``, whatever its namespace (SSD relocation)."""
        found = [self._entries[key]] if key in self._entries else []
        if self._shadow:
            found += [e for (_, k), e in self._shadow.items() if k == key]
        return found

    def entries(self) -> Iterator[Entry]:
        return iter([*self._entries.values(), *self._shadow.values()])

    def tier_count(self, tier: int) -> int:
        """Number of indexed entries that live in ``tier``."""
        return self._tier_counts[tier]

    def longest_prefix(self, ns: Namespace, keys: Sequence[bytes]) -> list[Entry]:
        """Entries of ``keys[0..n)`` for the largest ``n`` with every key present in ``ns``.

        ``ns`` must be the store's interned instance: membership is an identity check, so a
        key of another tenant's chain is a miss, never a hit.
        """
        if self._shadow:
            out = []
            for key in keys:
                entry = self.find(ns, key)
                if entry is None:
                    break
                out.append(entry)
            return out
        get = self._entries.get
        out = []
        append = out.append
        for key in keys:
            entry = get(key)
            if entry is None or entry.ns is not ns:
                break
            append(entry)
        return out

    def prefix_counts(self, ns: Namespace, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """Chunks and tokens per tier of the prefix of ``keys`` a lookup reports: the
        :meth:`longest_prefix`, cut before the first object still written by head ranges
        (``Entry.shards``: it counts once every range landed)."""
        chunks = [0] * len(self._tier_counts)
        tokens = [0] * len(self._tier_counts)
        if self._shadow:  # keys replayed by another namespace: find each one the slow way
            for entry in self.longest_prefix(ns, keys):
                if entry.shards is not None:
                    break
                chunks[entry.tier] += 1
                tokens[entry.tier] += entry.num_tokens
            return chunks, tokens
        tags: list[LookupTag | None] = []
        try:
            tags.extend(map(self._tags.__getitem__, keys))
        except KeyError:
            pass  # the prefix ends at the first absent key; ``tags`` holds the ones before
        start = 0
        for tag, run in groupby(tags):
            count = len(list(run))
            if tag is None:
                for key in keys[start : start + count]:
                    found = self._retag(self._entries[key])
                    if found is None or found.ns is not ns:
                        return chunks, tokens
                    chunks[found.tier] += 1
                    tokens[found.tier] += found.num_tokens
            elif tag.ns is not ns:  # another namespace's key is a miss in this one
                break
            else:
                chunks[tag.tier] += count
                tokens[tag.tier] += count * tag.num_tokens
            start += count
        return chunks, tokens

    def _retag(self, entry: Entry) -> LookupTag | None:
        """Set (and return) the tag of ``entry``, which is in ``_entries``."""
        tag = None
        if entry.shards is None:
            ns, tier = entry.ns, entry.tier
            if entry.num_tokens == ns.spec.chunk_tokens:
                tag = self._shared_tags.get((ns.seed, tier))
                if tag is None or tag.ns is not ns:
                    tag = self._shared_tags[(ns.seed, tier)] = LookupTag(ns, tier, entry.num_tokens)
            else:  # a partial chunk: its own tag (sizes would multiply the shared ones)
                tag = LookupTag(ns, tier, entry.num_tokens)
        self._tags[entry.key] = tag
        return tag

    def add(self, entry: Entry) -> None:
        key, ns = entry.key, entry.ns
        if self.find(ns, key) is not None:
            raise KeyError(f"{key.hex()} already indexed")
        if key in self._entries:
            self._shadow[(ns.seed, key)] = entry
        else:
            self._entries[key] = entry
            self._retag(entry)
        entry.kids = self._orphans.pop((ns.seed, key), None)
        self._tier_counts[entry.tier] += 1
        self._ns_entries[ns.seed] = self._ns_entries.get(ns.seed, 0) + 1
        self._peak = max(self._peak, len(self))
        parent = self.find(ns, entry.parent)
        if parent is not None:
            parent.kids = _add_kid(parent.kids, entry)
            self._refresh(parent, front=False)
        else:
            slot = (ns.seed, entry.parent)
            self._orphans[slot] = _add_kid(self._orphans.get(slot), entry)
        self._refresh(entry, front=False)

    def remove(self, entry: Entry) -> None:
        key, ns = entry.key, entry.ns
        if self._entries.get(key) is entry:
            del self._entries[key]
            del self._tags[key]
        elif self._shadow.get((ns.seed, key)) is entry:
            del self._shadow[(ns.seed, key)]
        else:
            return
        self._tier_counts[entry.tier] -= 1
        self._candidate_drop(entry, entry.tier)
        if entry.kids is not None:
            self._orphans[(ns.seed, key)] = entry.kids
            entry.kids = None
        parent = self.find(ns, entry.parent)
        if parent is not None:
            parent.kids = _remove_kid(parent.kids, entry)
            self._refresh(parent, front=True)
        else:
            slot = (ns.seed, entry.parent)
            left = _remove_kid(self._orphans.get(slot), entry)
            if left is None:
                self._orphans.pop(slot, None)
            else:
                self._orphans[slot] = left
        left_in_ns = self._ns_entries[ns.seed] - 1
        if left_in_ns:
            self._ns_entries[ns.seed] = left_in_ns
        else:
            del self._ns_entries[ns.seed]
            for tier in range(len(self._tier_counts)):
                self._shared_tags.pop((ns.seed, tier), None)
            if self._on_namespace_empty is not None:
                self._on_namespace_empty(ns)

    def touch(self, entry: Entry) -> None:
        """Mark a candidate most recently used (others are ordered through their children)."""
        candidates = self._candidates[entry.tier]
        if entry in candidates:
            candidates.move_to_end(entry)
            own = self._by_tenant.get((entry.ns.tenant_salt, entry.tier)) if self._tracked else None
            if own is not None and entry in own:
                own.move_to_end(entry)

    def _indexed(self, entry: Entry) -> bool:
        return self.find(entry.ns, entry.key) is entry

    def move(self, entry: Entry, tier: int, handle: Any) -> None:
        """Re-home an entry in another tier (demotion / promotion)."""
        indexed = self._indexed(entry)
        if indexed:
            self._candidate_drop(entry, entry.tier)
            self._tier_counts[entry.tier] -= 1
            self._tier_counts[tier] += 1
        entry.tier = tier
        entry.handle = handle
        if indexed:
            if self._entries.get(entry.key) is entry:
                self._retag(entry)
            self._refresh(entry, front=False)
            parent = self.find(entry.ns, entry.parent)
            if parent is not None:
                self._refresh(parent, front=True)

    def pick_victim(self, tier: int, tenant: str | None = None) -> Entry | None:
        """The least recently used candidate of ``tier`` that is complete, unpinned, still
        (``tenant``: among that tracked tenant's entries only)."""
        candidates = (
            self._candidates[tier]
            if tenant is None
            else self._by_tenant.get((tenant, tier), OrderedDict())
        )
        for entry in candidates:
            if entry.pins == 0 and entry.ready == READY_ALL and not entry.flags & MOVING:
                return entry
        return None

    def pick_victim_for_eviction(self, tier: int) -> Entry | None:
        """Like :meth:`pick_victim`, but only true leaves: removing it orphans nothing."""
        for entry in self._candidates[tier]:
            if (
                entry.kids is None
                and entry.pins == 0
                and entry.ready == READY_ALL
                and not entry.flags & MOVING
            ):
                return entry
        return None

    def candidates(self, tier: int) -> list[bytes]:
        """Candidate keys of ``tier``, least recently used first (tests, introspection)."""
        return [entry.key for entry in self._candidates[tier]]

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
        if not eligible:
            self._candidate_drop(entry, tier)
        elif entry not in self._candidates[tier]:
            self._candidate_put(entry, front)
