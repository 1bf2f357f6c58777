"""The node-local tiered KV store.

Public operations (all thread-safe; every one takes the namespace, which the store enforces:
a key of another namespace is a miss, never a hit):

* :meth:`TieredStore.reserve` / :meth:`~TieredStore.put` — pages are allocated in the first
  memory tier with room (demoting colder objects down the tier order to make it); the
  producer writes layers into them and commits layer by layer (:class:`ObjectWriter`).
* :meth:`~TieredStore.get` / :meth:`~TieredStore.pin` — a pinned, zero-copy
  :class:`ObjectReader`; an object on SSD is first read back into memory (checksum verified),
  and an object in a lower memory tier is promoted on hit.
* :meth:`~TieredStore.lookup` — longest stored prefix of a chain of keys, per tier.
* :meth:`~TieredStore.contains`, :meth:`~TieredStore.delete`, :meth:`~TieredStore.stats`.

Placement: tiers are ordered fastest first (``device``/``dram``, ``cxl``, ``ssd``). When a
tier passes its high watermark, a maintenance thread demotes victims to the next tier until
the low watermark; a put that finds no room demotes synchronously. The last tier evicts.
Victims are chosen by :class:`~kvfabric.store.index.LocalIndex`: leaves of a chain first,
LRU among leaves; pinned, moving or incomplete objects never. Every eviction is counted.

Durability: an SSD demotion is acknowledged (the object leaves memory) only once its record
is written; SSD contents survive a restart and are re-indexed from the segment headers.
Memory tiers are volatile.

Locking: one re-entrant lock guards the index, the tiers' allocators and the counters. Bulk
copies between memory tiers run under it (they are memcpy-fast); SSD reads and writes run
outside it, with the object marked MOVING.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from kvfabric.errors import (AlreadyExistsError, CapacityError, ConfigError, CorruptRecordError,
                             DeadlineExceededError, KVFabricError, LeaseExpiredError,
                             NotFoundError, ObjectAbortedError, SpecError, SpecMismatchError)
from kvfabric.hashing import KEY_BYTES, ROOT, chunk_keys
from kvfabric.memory.copy import Piece, copy_pieces
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store.config import StoreConfig
from kvfabric.store.factory import AnyTier, build_tier
from kvfabric.store.handles import ObjectReader, ObjectWriter, _Lease
from kvfabric.store.index import ABORTED, MOVING, READY_ALL, REMOVED, Entry, LocalIndex
from kvfabric.store.stats import (NamespaceCounters, NamespaceStats, StoreStats, TierCounters,
                                  TierStats)
from kvfabric.tiers.base import PagedTier
from kvfabric.tiers.disk import DiskExtent, DiskTier, StaleExtentError

log = logging.getLogger(__name__)

MAX_NAMESPACES = 1 << 16


@dataclass(frozen=True)
class LookupResult:
    """Longest stored prefix of a chain: how many chunks / tokens, and in which tiers."""

    requested_chunks: int
    matched_chunks: int
    matched_tokens: int
    tier_tokens: dict[str, int]  # matched tokens per tier name (only tiers that matched)


class TieredStore:
    """Objects (chunks) in memory / SSD tiers with a prefix-aware local index."""

    def __init__(self, config: StoreConfig | None = None, *, maintenance: bool = True) -> None:
        self.config = config or StoreConfig()
        data_dir = Path(self.config.data_dir)
        try:
            data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"data_dir {str(data_dir)!r} cannot be created: {exc}") from None
        self._names = [t.name for t in self.config.tiers]
        self._tiers: list[AnyTier] = []
        try:
            for tier_config in self.config.tiers:
                self._tiers.append(build_tier(tier_config, data_dir.resolve()))
        except BaseException:
            for tier in self._tiers:
                tier.close()
            raise
        last = self._tiers[-1]
        self._disk_index = len(self._tiers) - 1 if isinstance(last, DiskTier) else None
        self._paged = [i for i, t in enumerate(self._tiers) if isinstance(t, PagedTier)]
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._index = LocalIndex(len(self._tiers))
        self._tier_counters = [TierCounters() for _ in self._tiers]
        self._ns_counters: dict[tuple[str, str], NamespaceCounters] = {}
        self._namespaces: dict[bytes, Namespace] = {}
        self._leases: dict[int, _Lease] = {}
        self._pending_demotion = [0] * len(self._tiers)  # bytes being written to SSD
        self._draining = [False] * len(self._tiers)
        self._count = dict.fromkeys(("lookups", "lookup_tokens", "hit_tokens", "miss_tokens",
                                     "puts", "gets", "deletes", "expired", "aborted"), 0)
        self._closed = False
        if self._disk_index is not None:
            self._recover()
        self._stop = threading.Event()
        self._maintainer: threading.Thread | None = None
        if maintenance:
            self._maintainer = threading.Thread(target=self._maintain_loop, daemon=True,
                                                name="kvfabric-store-maintenance")
            self._maintainer.start()

    # ------------------------------------------------------------------ writing

    def reserve(self, ns: Namespace, key: bytes, *, parent: bytes = ROOT,
                num_tokens: int | None = None) -> ObjectWriter:
        """Allocate an object and return its writer (commit layers, or abort)."""
        _check_key("key", key)
        _check_key("parent", parent)
        num_tokens = ns.spec.chunk_tokens if num_tokens is None else num_tokens
        nbytes = ns.spec.layout(num_tokens).nbytes  # validates num_tokens
        with self._lock:
            self._check_open()
            ns = self._intern(ns)
            if key in self._index:
                raise AlreadyExistsError(f"{key.hex()} is already stored or being written")
            tier, pages = self._allocate(nbytes)
            entry = Entry(key, parent, ns, num_tokens, tier, pages)
            entry.pins = 1  # the writer's reservation
            self._index.add(entry)
            writer = ObjectWriter(self, entry, time.monotonic() + self.config.reservation_timeout_s)
            self._leases[id(writer)] = writer
            return writer

    def put(self, ns: Namespace, key: bytes, data: Any, *, parent: bytes = ROOT,
            num_tokens: int | None = None) -> bool:
        """Store a whole payload in canonical layout; ``False`` if the key is already stored."""
        try:
            writer = self.reserve(ns, key, parent=parent, num_tokens=num_tokens)
        except AlreadyExistsError:
            return False
        with writer:
            writer.write(data)
            writer.commit()
        return True

    def _commit_layers(self, writer: ObjectWriter, mask: int) -> None:
        with self._lock:
            if writer.expired:
                raise LeaseExpiredError(f"reservation of {writer.key.hex()} expired")
            entry = writer._entry
            if entry.flags & ABORTED:
                raise ObjectAbortedError(f"{writer.key.hex()} was deleted while being written")
            full = (1 << entry.ns.spec.num_layers) - 1
            ready = entry.ready | mask
            if ready == full:
                entry.ready = READY_ALL
                self._end_lease(writer)
                self._count["puts"] += 1
                self._tier_counters[entry.tier].bytes_in += writer.nbytes
            else:
                entry.ready = ready
            self._cond.notify_all()

    def _abort(self, writer: ObjectWriter) -> None:
        with self._lock:
            if writer.closed or writer.expired:
                return
            self._abort_entry(writer._entry)
            self._end_lease(writer)

    def _abort_entry(self, entry: Entry) -> None:
        entry.flags |= ABORTED
        self._count["aborted"] += 1
        self._drop(entry)
        self._cond.notify_all()

    # ------------------------------------------------------------------ reading

    def get(self, ns: Namespace, key: bytes, *, timeout: float | None = None,
            lease_s: float | None = None) -> ObjectReader:
        """Pin an object (possibly still being written) and return its reader."""
        _check_key("key", key)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._check_open()
                ns = self._intern(ns)
                entry = self._find(ns, key)
                if entry.flags & MOVING and entry.tier == self._disk_index:
                    self._wait(deadline, f"{key.hex()} is being read back from SSD")
                    continue
                if entry.tier != self._disk_index:
                    if (self.config.promote_on_hit and entry.tier != self._paged[0]
                            and entry.complete and entry.pins == 0 and not entry.flags & MOVING):
                        self._promote_in_memory(entry)
                    return self._pin(entry, lease_s)
                extent, target = entry.handle, self._start_disk_promotion(entry)
            self._finish_disk_promotion(entry, extent, target)

    def pin(self, ns: Namespace, key: bytes, lease_s: float) -> ObjectReader:
        """:meth:`get` with an explicit pin deadline (seconds)."""
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        return self.get(ns, key, lease_s=lease_s)

    def unpin(self, reader: ObjectReader) -> None:
        reader.release()

    def _pin(self, entry: Entry, lease_s: float | None) -> ObjectReader:
        entry.pins += 1
        self._index.touch(entry)
        self._count["gets"] += 1
        lease = self.config.pin_timeout_s if lease_s is None else lease_s
        reader = ObjectReader(self, entry, time.monotonic() + lease)
        self._leases[id(reader)] = reader
        self._tier_counters[entry.tier].bytes_out += reader.nbytes
        return reader

    def _unpin(self, reader: ObjectReader) -> None:
        with self._lock:
            if not reader.closed and not reader.expired:
                self._end_lease(reader)

    def _end_lease(self, lease: _Lease) -> None:
        lease.closed = True
        self._leases.pop(id(lease), None)
        entry = lease._entry
        entry.pins -= 1
        self._free_if_dead(entry)

    def _layer_ready(self, entry: Entry, layer: int) -> bool:
        return entry.ready == READY_ALL or bool(entry.ready >> layer & 1)

    def _wait_layer(self, entry: Entry, layer: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._layer_ready(entry, layer):
                if entry.flags & ABORTED:
                    raise ObjectAbortedError(f"the writer of {entry.key.hex()} aborted")
                self._wait(deadline, f"layer {layer} of {entry.key.hex()} not committed")

    def _pieces(self, entry: Entry, offset: int, length: int) -> list[Piece]:
        tier = self._tiers[entry.tier]
        assert isinstance(tier, PagedTier)
        return tier.pieces(entry.handle, offset, length)

    # ------------------------------------------------------------------ queries

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of the chain ``keys`` stored in ``ns`` (in-flight writes count)."""
        with self._lock:
            ns = self._intern(ns)
            entries = self._index.longest_prefix(ns, keys)
            per_tier = [0] * len(self._tiers)
            for entry in entries:
                per_tier[entry.tier] += entry.num_tokens
            matched = sum(per_tier)
            requested = matched + (len(keys) - len(entries)) * ns.spec.chunk_tokens
            self._count_lookup(ns, requested, matched, per_tier, entries)
        return LookupResult(len(keys), len(entries), matched,
                            {self._names[i]: n for i, n in enumerate(per_tier) if n})

    def lookup_tokens(self, ns: Namespace, tokens: Any) -> LookupResult:
        """:meth:`lookup` of a prompt's full chunks, hashed here."""
        return self.lookup(ns, chunk_keys(ns, tokens, include_partial=False))

    def _count_lookup(self, ns: Namespace, requested: int, matched: int, per_tier: list[int],
                      entries: list[Entry]) -> None:
        count = self._count
        count["lookups"] += 1
        count["lookup_tokens"] += requested
        count["hit_tokens"] += matched
        count["miss_tokens"] += requested - matched
        for i, tokens in enumerate(per_tier):
            if tokens:
                self._tier_counters[i].hit_tokens += tokens
                self._tier_counters[i].hit_chunks += sum(1 for e in entries if e.tier == i)
        nsc = self._ns_counters.setdefault((ns.model_id, ns.tenant_salt), NamespaceCounters())
        nsc.lookups += 1
        nsc.lookup_tokens += requested
        nsc.hit_tokens += matched

    def contains(self, ns: Namespace, key: bytes) -> bool:
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and entry.ns == ns

    def tier_of(self, ns: Namespace, key: bytes) -> str:
        with self._lock:
            return self._names[self._find(self._intern(ns), key).tier]

    def delete(self, ns: Namespace, key: bytes) -> bool:
        """Remove an object (a writer in progress is aborted); ``False`` if absent."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.ns != ns:
                return False
            self._count["deletes"] += 1
            if entry.complete:
                self._drop(entry)
            else:
                self._abort_entry(entry)
            return True

    def evict(self, tier: str | None = None, nbytes: int | None = None) -> int:
        """Admin: drop unpinned objects (of one tier, or from the last tier up) until
        ``nbytes`` are freed, or all of them. Returns how many were evicted (and counted)."""
        if tier is not None and tier not in self._names:
            raise NotFoundError(f"no tier named {tier!r}; tiers: {self._names}")
        order = [self._names.index(tier)] if tier is not None else \
            list(range(len(self._tiers) - 1, -1, -1))
        evicted = freed = 0
        with self._lock:
            for tier_index in order:
                while nbytes is None or freed < nbytes:
                    victim = self._index.pick_victim_for_eviction(tier_index)
                    if victim is None:
                        break
                    freed += victim.ns.spec.layout(victim.num_tokens).nbytes
                    self._evict(victim)
                    evicted += 1
        return evicted

    def tier_name(self, index: int) -> str:
        return self._names[index]

    @property
    def tier_names(self) -> list[str]:
        return list(self._names)

    def __len__(self) -> int:
        return len(self._index)

    # ------------------------------------------------------------------ placement

    def _allocate(self, nbytes: int) -> tuple[int, Any]:
        """Pages in the first memory tier that can make room; CapacityError otherwise."""
        errors = []
        for tier_index in self._paged:
            try:
                self._make_room(tier_index, nbytes)
                return tier_index, self._tiers[tier_index].allocate(nbytes)  # type: ignore
            except CapacityError as exc:
                errors.append(f"{self._names[tier_index]}: {exc}")
        raise CapacityError(f"no memory tier can hold {nbytes} bytes ({'; '.join(errors)})")

    def _make_room(self, tier_index: int, nbytes: int) -> None:
        tier = self._tiers[tier_index]
        assert isinstance(tier, PagedTier)
        if nbytes > tier.capacity_bytes:
            raise CapacityError(f"object of {nbytes} bytes is larger than the tier")
        reclaimed = False
        deadline = time.monotonic() + self.config.reservation_timeout_s
        while not tier.can_fit(nbytes):
            victim = self._index.pick_victim(tier_index)
            if victim is not None:
                self._demote(victim)
            elif self._pending_demotion[tier_index]:
                self._wait(deadline, "waiting for SSD demotions to free memory")
            elif not reclaimed:
                reclaimed = True  # a dead client's leases may be what holds the memory
                self._reclaim_expired(time.monotonic())
            else:
                raise CapacityError(f"{self._names[tier_index]} is full of pinned or "
                                    f"incomplete objects")

    def _demote(self, entry: Entry) -> None:
        """Move a victim one tier down, or evict it from the last tier (lock held)."""
        src_index = entry.tier
        dst_index = src_index + 1
        if dst_index >= len(self._tiers):
            self._evict(entry)
            return
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        if dst_index == self._disk_index:
            self._demote_to_disk(entry, nbytes)
            return
        try:
            pages = self._claim_pages(entry, dst_index, nbytes)
        except CapacityError:
            if self._index.get(entry.key) is entry and not entry.pins:
                self._evict(entry)  # nowhere below has room: this is the one that goes
            return
        if pages is not None:
            self._move_in_memory(entry, dst_index, pages, nbytes)
            self._tier_counters[src_index].demotions += 1

    def _promote_in_memory(self, entry: Entry) -> None:
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        src_index = entry.tier
        try:
            pages = self._claim_pages(entry, self._paged[0], nbytes)
        except CapacityError:
            return  # served from where it is
        if pages is not None:
            self._tier_counters[src_index].promotions += 1
            self._move_in_memory(entry, self._paged[0], pages, nbytes)

    def _claim_pages(self, entry: Entry, tier_index: int, nbytes: int) -> Any | None:
        """Pages in ``tier_index`` to move ``entry`` into, or None if it changed meanwhile.

        Making room may wait (the lock is released), so the entry is marked MOVING to keep
        other movers off it, and re-checked afterwards: a reader that pinned it, or a delete,
        wins over the move.
        """
        src_index = entry.tier
        entry.flags |= MOVING
        try:
            self._make_room(tier_index, nbytes)
            pages = self._tiers[tier_index].allocate(nbytes)  # type: ignore[union-attr]
        finally:
            entry.flags &= ~MOVING
        if entry.flags & REMOVED or entry.tier != src_index or entry.pins:
            self._tiers[tier_index].free(pages)  # type: ignore[union-attr]
            self._free_if_dead(entry)
            return None
        return pages

    def _move_in_memory(self, entry: Entry, dst_index: int, pages: Any, nbytes: int) -> None:
        src = self._tiers[entry.tier]
        dst = self._tiers[dst_index]
        assert isinstance(src, PagedTier) and isinstance(dst, PagedTier)
        copy_pieces(dst.pieces(pages, 0, nbytes), src.pieces(entry.handle, 0, nbytes))
        old = entry.handle
        self._index.move(entry, dst_index, pages)
        src.free(old)

    def _demote_to_disk(self, entry: Entry, nbytes: int) -> None:
        disk = self._tiers[self._disk_index]  # type: ignore[index]
        assert isinstance(disk, DiskTier)
        pieces = self._pieces(entry, 0, nbytes)
        if pieces and not isinstance(pieces[0], np.ndarray):  # device memory: stage on host
            staged = np.empty(nbytes, dtype=np.uint8)
            copy_pieces([staged], pieces)
            pieces = [staged]
        try:
            future = disk.write(entry.key, _encode_meta(entry), pieces)
        except CapacityError:
            self._evict_disk_leaves(nbytes)
            self._evict(entry)
            return
        src_index = entry.tier
        entry.flags |= MOVING
        self._pending_demotion[src_index] += nbytes
        future.add_done_callback(
            lambda f: self._finish_disk_demotion(entry, src_index, nbytes, pieces, f))

    def _finish_disk_demotion(self, entry: Entry, src_index: int, nbytes: int,
                              pieces: list[Piece], future: "Future[DiskExtent]") -> None:
        del pieces  # kept alive until the write completed
        with self._lock:
            self._pending_demotion[src_index] -= nbytes
            entry.flags &= ~MOVING
            disk = self._tiers[self._disk_index]  # type: ignore[index]
            assert isinstance(disk, DiskTier)
            error = future.exception()
            if error is not None:
                log.warning("SSD demotion of %s failed: %s", entry.key.hex(), error)
            elif entry.flags & REMOVED or entry.pins:
                disk.delete(future.result())  # deleted meanwhile, or hot again: keep in memory
            else:
                old = entry.handle
                self._index.move(entry, self._disk_index, future.result())
                self._tiers[src_index].free(old)  # type: ignore[union-attr]
                self._tier_counters[src_index].demotions += 1
                self._tier_counters[self._disk_index].bytes_in += nbytes  # type: ignore[index]
            self._free_if_dead(entry)
            self._cond.notify_all()

    def _start_disk_promotion(self, entry: Entry) -> tuple[int, Any]:
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        entry.flags |= MOVING  # first: allocating may wait, and other readers must wait too
        try:
            return self._allocate(nbytes)
        except BaseException:
            entry.flags &= ~MOVING
            self._free_if_dead(entry)
            self._cond.notify_all()
            raise

    def _finish_disk_promotion(self, entry: Entry, extent: DiskExtent,
                               target: tuple[int, Any]) -> None:
        tier_index, pages = target
        tier = self._tiers[tier_index]
        disk = self._tiers[self._disk_index]  # type: ignore[index]
        assert isinstance(tier, PagedTier) and isinstance(disk, DiskTier)
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        try:
            pieces = tier.pieces(pages, 0, nbytes)
            staged = None
            if pieces and not isinstance(pieces[0], np.ndarray):  # device: land on host first
                staged = np.empty(nbytes, dtype=np.uint8)
            self._read_disk_record(disk, entry, extent, pieces if staged is None else [staged])
            if staged is not None:
                copy_pieces(pieces, [staged])
        except BaseException as exc:
            with self._lock:
                entry.flags &= ~MOVING
                tier.free(pages)
                if isinstance(exc, CorruptRecordError):
                    self._drop(entry, disk_already_dead=True)
                self._cond.notify_all()
            if isinstance(exc, CorruptRecordError):
                raise NotFoundError(f"{entry.key.hex()} was corrupt on SSD and was dropped: "
                                    f"{exc}") from None
            raise
        with self._lock:
            entry.flags &= ~MOVING
            if entry.flags & REMOVED:
                tier.free(pages)
                self._free_if_dead(entry)
            else:
                disk.delete(entry.handle)  # compaction may have moved it: use the current one
                self._index.move(entry, tier_index, pages)
                self._tier_counters[self._disk_index].promotions += 1  # type: ignore[index]
                self._tier_counters[self._disk_index].bytes_out += nbytes  # type: ignore[index]
            self._cond.notify_all()

    def _read_disk_record(self, disk: DiskTier, entry: Entry, extent: DiskExtent,
                          pieces: list[Piece]) -> None:
        """Read an entry's record; if compaction moved it meanwhile, follow it."""
        for _ in range(3):
            try:
                disk.read_into(extent, pieces, key=entry.key)
                return
            except StaleExtentError:
                with self._lock:
                    if entry.handle == extent or entry.flags & REMOVED:
                        raise
                    extent = entry.handle
        disk.read_into(extent, pieces, key=entry.key)

    def _evict(self, entry: Entry) -> None:
        self._tier_counters[entry.tier].evictions += 1
        self._drop(entry)

    def _evict_disk_leaves(self, nbytes: int) -> None:
        """Delete SSD leaves worth ``nbytes``; compaction returns the space later."""
        freed = 0
        while freed < nbytes:
            victim = self._index.pick_victim(self._disk_index)  # type: ignore[arg-type]
            if victim is None:
                return
            freed += victim.ns.spec.layout(victim.num_tokens).nbytes
            self._evict(victim)

    def _drop(self, entry: Entry, *, disk_already_dead: bool = False) -> None:
        """Take an entry out of the index; its storage goes when the last pin does."""
        self._index.remove(entry)
        entry.flags |= REMOVED
        if disk_already_dead and entry.tier == self._disk_index:
            entry.handle = None
        self._free_if_dead(entry)

    def _free_if_dead(self, entry: Entry) -> None:
        if not entry.flags & REMOVED or entry.pins or entry.flags & MOVING:
            return
        if entry.handle is None:
            return
        tier = self._tiers[entry.tier]
        if isinstance(tier, DiskTier):
            tier.delete(entry.handle)
        else:
            tier.free(entry.handle)
        entry.handle = None

    # ------------------------------------------------------------------ maintenance

    def _reclaim_expired(self, now: float) -> int:
        expired = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in expired:
            entry = lease._entry
            if isinstance(lease, ObjectWriter) and not entry.complete:
                self._abort_entry(entry)
            log.warning("%s on %s expired; reclaimed", type(lease).__name__, entry.key.hex())
            self._end_lease(lease)
            lease.expired = True
        self._count["expired"] += len(expired)
        if expired:
            self._cond.notify_all()
        return len(expired)

    def maintain(self) -> None:
        """One maintenance pass: expire leases, demote above watermarks, compact the SSD."""
        with self._lock:
            if self._closed:
                return
            self._reclaim_expired(time.monotonic())
            for tier_index in self._paged:
                self._drain_to_low_watermark(tier_index)
            disk = self._disk()
            if disk is not None and disk.used_bytes > self.config.high_watermark * \
                    disk.capacity_bytes:
                live = disk.stats().live_bytes
                self._evict_disk_leaves(int(live - self.config.low_watermark *
                                            disk.capacity_bytes))
        if disk is not None:
            disk.compact(self._relocate, min_dead_ratio=self.config.compact_dead_ratio)

    def _drain_to_low_watermark(self, tier_index: int) -> None:
        """Hysteresis: once a tier passes the high watermark, demote until the low one."""
        tier = self._tiers[tier_index]
        cap = tier.capacity_bytes
        used = tier.used_bytes - self._pending_demotion[tier_index]
        if used > self.config.high_watermark * cap:
            self._draining[tier_index] = True
        while self._draining[tier_index]:
            if tier.used_bytes - self._pending_demotion[tier_index] <= \
                    self.config.low_watermark * cap:
                self._draining[tier_index] = False
                return
            victim = self._index.pick_victim(tier_index)
            if victim is None:
                return  # the rest is pinned, moving or waiting on its children: next pass
            self._demote(victim)

    def _relocate(self, key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.tier != self._disk_index or entry.handle != old:
                return False
            entry.handle = new
            return True

    def _maintain_loop(self) -> None:
        while not self._stop.wait(self.config.maintenance_interval_s):
            try:
                self.maintain()
            except Exception:  # the loop must outlive any one bad pass
                log.exception("store maintenance pass failed")

    def _disk(self) -> DiskTier | None:
        if self._disk_index is None:
            return None
        disk = self._tiers[self._disk_index]
        assert isinstance(disk, DiskTier)
        return disk

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every SSD write queued so far has completed and been indexed."""
        disk = self._disk()
        if disk is None:
            return
        disk.flush()
        deadline = time.monotonic() + timeout
        with self._lock:  # the index switches in the writer's completion callback
            while any(self._pending_demotion):
                self._wait(deadline, "SSD demotions did not complete")

    def _recover(self) -> None:
        disk = self._disk()
        assert disk is not None
        for record in disk.scan():
            try:
                ns, parent, num_tokens = _decode_meta(record.meta)
            except (KVFabricError, ValueError, TypeError, KeyError) as exc:
                log.warning("SSD record %s has unreadable metadata (%s); dropped",
                            record.key.hex(), exc)
                disk.delete(record.extent)
                continue
            entry = Entry(record.key, parent, self._intern(ns), num_tokens,
                          self._disk_index, record.extent)  # type: ignore[arg-type]
            entry.ready = READY_ALL
            self._index.add(entry)

    # ------------------------------------------------------------------ helpers

    def _intern(self, ns: Namespace) -> Namespace:
        known = self._namespaces.get(ns.seed)
        if known is not None:
            return known
        if len(self._namespaces) >= MAX_NAMESPACES:
            raise SpecError(f"too many namespaces (limit {MAX_NAMESPACES})")
        self._namespaces[ns.seed] = ns
        return ns

    def _find(self, ns: Namespace, key: bytes) -> Entry:
        entry = self._index.get(key)
        if entry is not None and entry.ns is ns:
            return entry
        if entry is not None and (entry.ns.model_id, entry.ns.tenant_salt, entry.ns.lora_id) == \
                (ns.model_id, ns.tenant_salt, ns.lora_id):
            raise SpecMismatchError(f"{key.hex()} is stored with spec {entry.ns.spec}, "
                                    f"requested {ns.spec}")
        raise NotFoundError(f"no object {key.hex()} in this namespace")

    def _wait(self, deadline: float | None, what: str) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceededError(f"timed out: {what}")
        self._cond.wait(remaining if remaining is not None else 1.0)

    def _check_open(self) -> None:
        if self._closed:
            raise KVFabricError("store is closed")

    # ------------------------------------------------------------------ stats / lifecycle

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = []
            for i, tier in enumerate(self._tiers):
                c = self._tier_counters[i]
                extra: dict[str, int] = {}
                if isinstance(tier, DiskTier):
                    disk_stats = tier.stats()
                    extra = {"corrupt_records": disk_stats.corrupt_records,
                             "torn_records": disk_stats.torn_records}
                tiers.append(TierStats(
                    name=self._names[i], kind=self.config.tiers[i].kind.value,
                    capacity_bytes=tier.capacity_bytes, used_bytes=tier.used_bytes,
                    objects=self._index.tier_count(i), hit_tokens=c.hit_tokens,
                    hit_chunks=c.hit_chunks, evictions=c.evictions, promotions=c.promotions,
                    demotions=c.demotions, bytes_in=c.bytes_in, bytes_out=c.bytes_out, **extra))
            count = self._count
            return StoreStats(
                tiers=tuple(tiers), objects=len(self._index), lookups=count["lookups"],
                lookup_tokens=count["lookup_tokens"], hit_tokens=count["hit_tokens"],
                miss_tokens=count["miss_tokens"], puts=count["puts"], gets=count["gets"],
                deletes=count["deletes"], expired_leases=count["expired"],
                aborted_writes=count["aborted"],
                namespaces=tuple(NamespaceStats(m, t, c.lookups, c.lookup_tokens, c.hit_tokens)
                                 for (m, t), c in sorted(self._ns_counters.items())))

    def close(self) -> None:
        """Stop maintenance, finish queued SSD writes, release all memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._maintainer is not None:
            self._maintainer.join()
        disk = self._disk()
        if disk is not None:
            try:
                self.flush()
            except DeadlineExceededError:
                log.warning("closing with SSD demotions still in flight")
            disk.close()  # joins the writers: never under the lock their callbacks take
        with self._lock:
            for tier in self._tiers:
                if tier is not disk:
                    tier.close()
            self._cond.notify_all()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_key(name: str, key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise SpecError(f"{name} must be {KEY_BYTES} bytes")


def _encode_meta(entry: Entry) -> bytes:
    ns = entry.ns
    return msgpack.packb({"v": 1, "parent": entry.parent, "tokens": entry.num_tokens,
                          "model": ns.model_id, "tenant": ns.tenant_salt, "lora": ns.lora_id,
                          "spec": ns.spec.to_dict()})


def _decode_meta(raw: bytes) -> tuple[Namespace, bytes, int]:
    meta = msgpack.unpackb(raw)
    if not isinstance(meta, dict) or meta.get("v") != 1:
        raise ValueError("unknown metadata version")
    spec = KVSpec.from_dict(meta["spec"])
    ns = Namespace(meta["model"], spec, meta["tenant"], meta["lora"])
    parent = meta["parent"]
    _check_key("parent", parent)
    spec.layout(meta["tokens"])
    return ns, parent, int(meta["tokens"])
