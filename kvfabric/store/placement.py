"""Placement: where objects live and how they move between tiers.

Allocation in the first memory tier with room; demotion of candidates (see
:mod:`kvfabric.store.index`) one tier down when a tier must make room or passes its high
watermark (write-behind to SSD through the disk tier's writers); promotion on hit; eviction
from the last tier; and the end of an object's storage once it is removed and unpinned.

SSD copies: an object read back from SSD keeps its record there (``Entry.ssd_copy``), so a
crash after the read still finds it and demoting it again is a switch, not a write. The
copies go first (oldest promotion first) when the SSD needs space, and with the object.

A degraded SSD tier (a write fault: full disk, quota, I/O error) takes no demotions: the
victim is evicted instead (counted in the source tier's evictions and the SSD tier's
``refused_demotions``), never turned into an error for the put that needed the room.

Tenants' SSD quotas (:mod:`kvfabric.store.ssd_usage`): before a tenant's record is queued,
its own SSD copies and then its own SSD leaves (oldest first) are given up until the record
fits its quota; when they cannot make room the victim is evicted from memory instead
(counted in the SSD tier's ``quota_refused_demotions``). A tenant with an SSD quota that
finds the disk full makes room among its own records too, never among other tenants'.

Every method is called with the store lock held (``cond``'s lock, re-entrant). Methods that
may wait (for SSD demotions to free memory) do so on ``cond``, which releases the lock, so
an entry can change meanwhile: movers mark it MOVING and re-check it afterwards. SSD reads
and writes themselves happen outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgpack
import numpy as np

from kvfabric.errors import (
    CapacityError,
    CorruptRecordError,
    DeadlineExceededError,
    NotFoundError,
    QuotaExceededError,
    WouldBlockError,
)
from kvfabric.hashing import KEY_BYTES
from kvfabric.memory.copy import Piece, copy_pieces, total_bytes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import codec
from kvfabric.store.config import StoreConfig
from kvfabric.store.factory import AnyTier
from kvfabric.store.index import FP8_COPY, FP8_ON_DISK, MOVING, REMOVED, Entry, LocalIndex
from kvfabric.store.ssd_usage import SsdUsage
from kvfabric.store.stats import TierCounters
from kvfabric.tiers.base import PagedTier
from kvfabric.tiers.disk import DiskExtent, DiskTier, StaleExtentError, TierDegradedError
from kvfabric.tiers.disk.records import record_span

log = logging.getLogger(__name__)


class Placement:
    """Tier placement and movement of the store's objects (state shared with the store)."""

    def __init__(
        self,
        tiers: list[AnyTier],
        names: list[str],
        index: LocalIndex,
        counters: list[TierCounters],
        cond: threading.Condition,
        config: StoreConfig,
        reclaim: Callable[[], object],
        on_inventory: Callable[[list[Entry], list[tuple[Entry, int]]], None],
        ssd: SsdUsage | None = None,
    ) -> None:
        self.tiers = tiers
        self.names = names
        self.index = index
        self.counters = counters
        self.config = config
        self._cond = cond
        self._reclaim = reclaim  # expire stale leases: they may be what holds the memory
        # complete objects that moved (stored, (entry, old tier)) or left (removed): the
        # store tells its inventory listeners
        self._on_inventory = on_inventory
        last = tiers[-1]
        self.disk_index = len(tiers) - 1 if isinstance(last, DiskTier) else None
        self.disk_format = (
            codec.NATIVE if self.disk_index is None else config.tiers[self.disk_index].format
        )
        self.paged = [i for i, t in enumerate(tiers) if isinstance(t, PagedTier)]
        self.pending_demotion = [0] * len(tiers)  # bytes being written to SSD, per source tier
        self.draining = [False] * len(tiers)
        self.nonblocking = threading.local()  # .on: wait() raises WouldBlockError instead
        # memory-resident entries that keep an SSD record (Entry.ssd_copy), oldest first;
        # and the same per tenant with an SSD quota (it gives up its own first)
        self.copies: dict[Entry, None] = {}
        self.tenant_copies: dict[str, dict[Entry, None]] = {}
        self.ssd = ssd or SsdUsage({})  # tenants' SSD bytes (records queued or written)

    @property
    def ssd_index(self) -> int:
        """The SSD tier's index, where the caller knows there is one."""
        assert self.disk_index is not None
        return self.disk_index

    def pieces(self, entry: Entry, offset: int, length: int) -> list[Piece]:
        tier = self.tiers[entry.tier]
        assert isinstance(tier, PagedTier)
        return tier.pieces(entry.handle, offset, length)

    def allocate(self, nbytes: int, tenant: str = "") -> tuple[int, Any]:
        """Pages for an object of ``tenant`` (its pool, in the tenant's arenas where it has
        them) in the first memory tier that can make room; CapacityError otherwise
        (QuotaExceededError when a tier refused because the tenant is at its quota there)."""
        errors = []
        quota = False
        for tier_index in self.paged:
            tier = self.tiers[tier_index]
            try:
                self.make_room(tier_index, nbytes, tenant)
                return tier_index, tier.allocate(nbytes, tier.pool_of(tenant))  # type: ignore
            except CapacityError as exc:
                quota = quota or isinstance(exc, QuotaExceededError)
                errors.append(f"{self.names[tier_index]}: {exc}")
        error = QuotaExceededError if quota else CapacityError
        raise error(f"no memory tier can hold {nbytes} bytes ({'; '.join(errors)})")

    def make_room(self, tier_index: int, nbytes: int, tenant: str = "") -> None:
        """Free pages in ``tier_index`` for ``nbytes`` of ``tenant``: a tenant whose own pool
        is full (its quota) demotes its own objects, and only those; otherwise victims are
        the tier's least recently used."""
        tier = self.tiers[tier_index]
        assert isinstance(tier, PagedTier)
        if nbytes > tier.capacity_bytes:
            raise CapacityError(f"object of {nbytes} bytes is larger than the tier")
        pool = tier.pool_of(tenant)
        reclaimed = False
        deadline = time.monotonic() + self.config.reservation_timeout_s
        # a tenant at its quota (a full pool as large as the tier is a full tier, below)
        if (
            pool is not None
            and tier.pool_bytes(pool) < tier.capacity_bytes
            and not tier.pool_can_fit(nbytes, pool)
        ):
            self.make_room_in_pool(tier_index, nbytes, tenant, deadline)
        while not tier.can_fit(nbytes, pool):
            pending = self.pending_demotion[tier_index]
            if pending and (pending >= nbytes or tier.can_fit(nbytes - pending)):
                # the SSD writes under way free enough: demoting more would only be churn
                # (can_fit(1) on a full tier, as before, demoted the whole tier at once)
                self.wait(deadline, "waiting for SSD demotions to free memory")
                continue
            victim = self.index.pick_victim(tier_index)
            if victim is not None:
                self.demote(victim)
            elif self.pending_demotion[tier_index]:
                self.wait(deadline, "waiting for SSD demotions to free memory")
            elif not reclaimed:
                reclaimed = True  # a dead client's leases may be what holds the memory
                self._reclaim()
            else:
                raise CapacityError(
                    f"{self.names[tier_index]} is full of pinned or incomplete objects"
                )

    def make_room_in_pool(self, tier_index: int, nbytes: int, tenant: str, deadline: float) -> None:
        """A tenant at its quota of a tier: demote its own objects there until its pool has
        the pages; QuotaExceededError when none can move."""
        tier = self.tiers[tier_index]
        assert isinstance(tier, PagedTier)
        pool = tier.pool_of(tenant)
        reclaimed = False
        in_flight: list[Entry] = []  # victims on their way to SSD: their pages free later
        while not tier.pool_can_fit(nbytes, pool):
            in_flight = [v for v in in_flight if v.flags & MOVING]
            short = tier.pages_for(nbytes) - tier.pool_free_pages(pool)
            if (
                in_flight
                and sum(tier.pages_for(v.ns.spec.layout(v.num_tokens).nbytes) for v in in_flight)
                >= short
            ):
                self.wait(deadline, "waiting for the tenant's SSD demotions to free memory")
                continue
            victim = self.index.pick_victim(tier_index, tenant)
            if victim is not None:
                self.demote(victim)
                in_flight.append(victim)
            elif in_flight:
                self.wait(deadline, "waiting for the tenant's SSD demotions to free memory")
            elif not reclaimed:
                reclaimed = True  # its own stale leases may be what holds its memory
                self._reclaim()
            else:
                raise QuotaExceededError(
                    f"tenant {tenant!r} holds its whole quota of {self.names[tier_index]} "
                    f"({tier.pool_bytes(pool)} bytes) in objects that cannot move (being "
                    f"written, read, or quarantined)"
                )

    def demote(self, entry: Entry) -> None:
        """Move a victim to the next lower tier that can take it (the SSD always can, by
        evicting its own leaves), or evict it when none can (lock held)."""
        src_index = entry.tier
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        for dst_index in range(src_index + 1, len(self.tiers)):
            if dst_index == self.disk_index:
                self.demote_to_disk(entry, nbytes)
                return
            try:
                pages = self.claim_pages(entry, dst_index, nbytes)
            except CapacityError:
                if entry.tier != src_index or entry.pins or entry.flags & REMOVED:
                    self.free_if_dead(entry)
                    return  # read, moved or deleted meanwhile: no longer this mover's
                continue  # that tier is full of pinned or moving objects: try the next
            if pages is not None:
                self.move_in_memory(entry, dst_index, pages, nbytes)
                self.counters[src_index].demotions += 1
            return
        self.evict(entry)  # nowhere below has room: this is the one that goes

    def promote_in_memory(self, entry: Entry) -> None:
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        src_index = entry.tier
        try:
            pages = self.claim_pages(entry, self.paged[0], nbytes)
        except CapacityError:
            return  # served from where it is
        if pages is not None:
            self.counters[src_index].promotions += 1
            self.move_in_memory(entry, self.paged[0], pages, nbytes)

    def claim_pages(self, entry: Entry, tier_index: int, nbytes: int) -> Any | None:
        """Pages in ``tier_index`` to move ``entry`` into, or None if it changed meanwhile.

        Making room may wait (the lock is released), so the entry is marked MOVING to keep
        other movers off it, and re-checked afterwards: a reader that pinned it, or a delete,
        wins over the move.
        """
        src_index = entry.tier
        tier, tenant = self.tiers[tier_index], entry.ns.tenant_salt
        entry.flags |= MOVING
        try:
            self.make_room(tier_index, nbytes, tenant)
            pages = tier.allocate(nbytes, tier.pool_of(tenant))  # type: ignore[union-attr]
        finally:
            entry.flags &= ~MOVING
        if entry.flags & REMOVED or entry.tier != src_index or entry.pins:
            self.tiers[tier_index].free(pages)  # type: ignore[union-attr]
            self.free_if_dead(entry)
            return None
        return pages

    def move_in_memory(self, entry: Entry, dst_index: int, pages: Any, nbytes: int) -> None:
        src = self.tiers[entry.tier]
        dst = self.tiers[dst_index]
        assert isinstance(src, PagedTier) and isinstance(dst, PagedTier)
        copy_pieces(dst.pieces(pages, 0, nbytes), src.pieces(entry.handle, 0, nbytes))
        old = entry.handle
        self.rehome(entry, dst_index, pages)
        src.free(old)

    def demote_to_disk(self, entry: Entry, nbytes: int) -> None:
        disk = self.tiers[self.ssd_index]
        assert isinstance(disk, DiskTier)
        if entry.ssd_copy is not None:  # its record is still there: nothing to write
            self.return_to_copy(entry)
            return
        if disk.degraded:
            self.refuse_demotion(entry)
            return
        tenant = entry.ns.tenant_salt
        fmt = self.disk_format if codec.encodable(entry.ns.spec) else codec.NATIVE
        meta = encode_meta(entry, fmt)
        # its span before any byte is encoded (an fp8 payload's size follows from the spec)
        span = record_span(
            len(meta),
            codec.encoded_nbytes(entry.ns.spec, entry.num_tokens) if fmt == codec.FP8 else nbytes,
        )
        if not self.make_ssd_room(tenant, span):
            self.counters[self.ssd_index].quota_refused_demotions += 1
            self.evict(entry)
            return
        pieces = self.pieces(entry, 0, nbytes)
        if fmt == codec.FP8:  # quantized on the way down (under the lock: a memory pass)
            pieces = [codec.encode(entry.ns.spec, entry.num_tokens, pieces)]
        elif pieces and not isinstance(pieces[0], np.ndarray):  # device memory: stage on host
            staged = np.empty(nbytes, dtype=np.uint8)
            copy_pieces([staged], pieces)
            pieces = [staged]
        try:
            future = disk.write(entry.key, meta, pieces)
        except TierDegradedError:  # degraded since the check above (by a writer thread)
            self.refuse_demotion(entry)
            return
        except CapacityError:  # a tenant with an SSD quota gives up its own records only
            self.evict_disk_leaves(nbytes, tenant if self.ssd.limit(tenant) else None)
            self.evict(entry)
            return
        self.ssd.add(tenant, span)
        src_index = entry.tier
        entry.flags |= MOVING
        self.pending_demotion[src_index] += nbytes
        future.add_done_callback(
            lambda f: self.finish_disk_demotion(entry, src_index, nbytes, span, pieces, fmt, f)
        )

    def make_ssd_room(self, tenant: str, span: int) -> bool:
        """Whether a record of ``span`` bytes of ``tenant`` fits its SSD quota, once its own
        SSD copies and leaves (oldest first) are given up as far as needed (nothing is given
        up for a record larger than the whole quota)."""
        excess = self.ssd.excess(tenant, span)
        if excess <= 0:
            return True
        if span > (self.ssd.limit(tenant) or 0):
            return False
        self.evict_disk_leaves(excess, tenant)
        return self.ssd.excess(tenant, span) <= 0

    def finish_disk_demotion(
        self,
        entry: Entry,
        src_index: int,
        nbytes: int,
        span: int,
        pieces: list[Piece],
        fmt: str,
        future: Future[DiskExtent],
    ) -> None:
        written = total_bytes(pieces)
        del pieces  # kept alive until the write completed
        with self._cond:
            self.pending_demotion[src_index] -= nbytes
            entry.flags &= ~MOVING
            disk = self.tiers[self.ssd_index]
            assert isinstance(disk, DiskTier)
            error = future.exception()
            if error is not None:  # no record: the tenant is not charged for it
                self.ssd.remove(entry.ns.tenant_salt, span)
            if isinstance(error, TierDegradedError):
                pass  # counted and logged (rate-limited) by the tier; the entry stays put
            elif error is not None:
                log.warning("SSD demotion of %s failed: %s", entry.key.hex(), error)
            elif entry.flags & REMOVED or entry.ssd_copy is not None:
                self.delete_record(entry, future.result())  # deleted meanwhile
            elif entry.pins:
                self.keep_copy(entry, future.result(), fp8=fmt == codec.FP8)  # hot again
            else:
                old = entry.handle
                self.rehome(entry, self.ssd_index, future.result())
                if fmt == codec.FP8:
                    entry.flags |= FP8_ON_DISK
                self.tiers[src_index].free(old)  # type: ignore[union-attr]
                self.counters[src_index].demotions += 1
                counters = self.counters[self.ssd_index]
                counters.bytes_in += nbytes
                counters.bytes_saved += nbytes - written
            self.free_if_dead(entry)
            self._cond.notify_all()

    def start_disk_promotion(self, entry: Entry) -> tuple[int, Any]:
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        entry.flags |= MOVING  # first: allocating may wait, and other readers must wait too
        try:
            return self.allocate(nbytes, entry.ns.tenant_salt)
        except BaseException:
            entry.flags &= ~MOVING
            self.free_if_dead(entry)
            self._cond.notify_all()
            raise

    def finish_disk_promotion(
        self, entry: Entry, extent: DiskExtent, target: tuple[int, Any]
    ) -> None:
        tier_index, pages = target
        tier = self.tiers[tier_index]
        disk = self.tiers[self.ssd_index]
        assert isinstance(tier, PagedTier) and isinstance(disk, DiskTier)
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        try:
            pieces = tier.pieces(pages, 0, nbytes)
            if entry.flags & FP8_ON_DISK:  # flag stable: set before, cleared after, the move
                raw = np.empty(extent.payload_len, dtype=np.uint8)
                self.read_disk_record(disk, entry, extent, [raw])
                codec.decode_into(entry.ns.spec, entry.num_tokens, raw, pieces)
            elif pieces and not isinstance(pieces[0], np.ndarray):  # device: via the host
                staged = np.empty(nbytes, dtype=np.uint8)
                self.read_disk_record(disk, entry, extent, [staged])
                copy_pieces(pieces, [staged])
            else:
                self.read_disk_record(disk, entry, extent, pieces)
        except BaseException as exc:
            # corrupt, or a stale extent the entry still names (its record was found bad by
            # compaction or is gone): never servable, so it leaves the index
            lost = isinstance(exc, (CorruptRecordError, StaleExtentError))
            with self._cond:
                entry.flags &= ~MOVING
                tier.free(pages)
                if lost:
                    self.drop(entry, disk_already_dead=True)
                self._cond.notify_all()
            if lost:
                what = "corrupt" if isinstance(exc, CorruptRecordError) else "gone"
                raise NotFoundError(
                    f"{entry.key.hex()} was {what} on SSD and was dropped: {exc}"
                ) from None
            raise
        with self._cond:
            entry.flags &= ~MOVING
            if entry.flags & REMOVED:
                tier.free(pages)
                self.free_if_dead(entry)
            else:
                # the record stays (compaction may have moved it: the current handle)
                self.keep_copy(entry, entry.handle, fp8=bool(entry.flags & FP8_ON_DISK))
                self.rehome(entry, tier_index, pages)
                entry.flags &= ~FP8_ON_DISK
                self.counters[self.ssd_index].promotions += 1
                self.counters[self.ssd_index].bytes_out += nbytes
            self._cond.notify_all()

    def read_disk_record(
        self, disk: DiskTier, entry: Entry, extent: DiskExtent, pieces: list[Piece]
    ) -> None:
        """Read an entry's record; if compaction moved it meanwhile, follow it."""
        for _ in range(3):
            try:
                disk.read_into(extent, pieces, key=entry.key)
                return
            except StaleExtentError:
                with self._cond:
                    if entry.handle == extent or entry.flags & REMOVED:
                        raise
                    extent = entry.handle
        disk.read_into(extent, pieces, key=entry.key)

    def evict(self, entry: Entry) -> None:
        self.counters[entry.tier].evictions += 1
        self.drop(entry)

    def refuse_demotion(self, entry: Entry) -> None:
        """The SSD tier is degraded: the victim is evicted instead (both counted)."""
        self.counters[self.ssd_index].refused_demotions += 1
        self.evict(entry)

    def keep_copy(self, entry: Entry, extent: DiskExtent, *, fp8: bool) -> None:
        """Remember the SSD record of an entry that now lives in memory (lock held)."""
        entry.ssd_copy = extent
        entry.flags = entry.flags | FP8_COPY if fp8 else entry.flags & ~FP8_COPY
        self.copies[entry] = None
        if self.ssd.limit(entry.ns.tenant_salt) is not None:
            self.tenant_copies.setdefault(entry.ns.tenant_salt, {})[entry] = None

    def forget_copy(self, entry: Entry) -> DiskExtent:
        """The entry no longer keeps its SSD record (returned); nothing is deleted."""
        extent = entry.ssd_copy
        entry.ssd_copy = None
        entry.flags &= ~FP8_COPY
        self.copies.pop(entry, None)
        own = self.tenant_copies.get(entry.ns.tenant_salt)
        if own is not None:
            own.pop(entry, None)
        return extent  # type: ignore[no-any-return]

    def drop_copy(self, entry: Entry) -> int:
        """Delete an entry's SSD copy; returns the record's span (lock held)."""
        extent = self.forget_copy(entry)
        self.delete_record(entry, extent)
        return int(extent.span)

    def delete_record(self, entry: Entry, extent: DiskExtent) -> None:
        """Delete an SSD record of ``entry``'s object; its tenant is charged no more."""
        self.disk().delete(extent)  # type: ignore[union-attr]
        self.ssd.remove(entry.ns.tenant_salt, extent.span)

    def return_to_copy(self, entry: Entry) -> None:
        """Demote an entry to the SSD record it kept: a switch of handles, no write."""
        src_index, old = entry.tier, entry.handle
        fp8 = bool(entry.flags & FP8_COPY)
        extent = self.forget_copy(entry)
        self.rehome(entry, self.ssd_index, extent)
        if fp8:
            entry.flags |= FP8_ON_DISK
        self.tiers[src_index].free(old)  # type: ignore[union-attr]
        self.counters[src_index].demotions += 1

    def evict_disk_leaves(self, nbytes: int, tenant: str | None = None) -> None:
        """Free SSD records worth ``nbytes`` (of ``tenant``'s objects only, one with an SSD
        quota, when given): the copies of memory-resident objects first (nothing is lost),
        then SSD leaves, oldest first; compaction returns the space later."""
        freed = 0
        copies = self.copies if tenant is None else self.tenant_copies.get(tenant, {})
        while freed < nbytes and copies:
            freed += self.drop_copy(next(iter(copies)))
        while freed < nbytes:
            victim = self.index.pick_victim(self.ssd_index, tenant)
            if victim is None:
                return
            freed += victim.handle.span
            self.evict(victim)

    def drop(self, entry: Entry, *, disk_already_dead: bool = False) -> None:
        """Take an entry out of the index; its storage goes when the last pin does (an SSD
        copy at once: a crash must not bring back what was deleted or evicted)."""
        was_listed = entry.complete and self.index.find(entry.ns, entry.key) is entry
        self.index.remove(entry)
        entry.flags |= REMOVED
        if entry.ssd_copy is not None:
            self.drop_copy(entry)
        if disk_already_dead and entry.tier == self.disk_index and entry.handle is not None:
            self.ssd.remove(entry.ns.tenant_salt, entry.handle.span)  # its record is DEAD
            entry.handle = None
        self.free_if_dead(entry)
        if was_listed:
            self._on_inventory([], [(entry, entry.tier)])

    def rehome(self, entry: Entry, tier_index: int, handle: Any) -> None:
        """Move an entry to another tier in the index (and tell the inventory listeners)."""
        old = entry.tier
        self.index.move(entry, tier_index, handle)
        if old != tier_index and entry.complete and not entry.flags & REMOVED:
            self._on_inventory([entry], [(entry, old)])

    def free_if_dead(self, entry: Entry) -> None:
        if not entry.flags & REMOVED or entry.pins or entry.flags & MOVING:
            return
        if entry.ssd_copy is not None:
            self.drop_copy(entry)
        if entry.handle is None:
            return
        tier = self.tiers[entry.tier]
        if isinstance(tier, DiskTier):
            self.delete_record(entry, entry.handle)
        else:
            tier.free(entry.handle)
        entry.handle = None

    def drain_to_low_watermark(self, tier_index: int) -> None:
        """Hysteresis: once a tier passes the high watermark, demote until the low one."""
        tier = self.tiers[tier_index]
        cap = tier.capacity_bytes
        used = tier.used_bytes - self.pending_demotion[tier_index]
        if used > self.config.high_watermark * cap:
            self.draining[tier_index] = True
        while self.draining[tier_index]:
            if (
                tier.used_bytes - self.pending_demotion[tier_index]
                <= self.config.low_watermark * cap
            ):
                self.draining[tier_index] = False
                return
            victim = self.index.pick_victim(tier_index)
            if victim is None:
                return  # the rest is pinned, moving or waiting on its children: next pass
            self.demote(victim)

    def spill(self) -> int:
        """Demote every complete, unpinned object from memory down to the SSD tier (so a
        restart finds it); returns how many moves were made. With the SSD full, the usual
        rule applies: its leaves are evicted for the (hotter) objects coming down."""
        if self.disk_index is None:
            return 0
        moves = 0
        budget = 3 * len(self.index) + 16  # a move that makes no progress cannot loop forever
        while budget > 0:
            moved_now = 0
            for tier_index in self.paged:
                while budget > 0 and (victim := self.index.pick_victim(tier_index)):
                    self.demote(victim)
                    moved_now += 1
                    budget -= 1
            moves += moved_now
            if not moved_now:
                if not any(self.pending_demotion):
                    return moves
                # parents become candidates once their children's SSD writes land
                self.wait(time.monotonic() + 60, "spilling to SSD")
        return moves

    def relocate(self, key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
        """Compaction moved a record: follow it (an SSD entry's handle, or a copy)."""
        with self._cond:
            for entry in self.index.any_with_key(key):
                if entry.tier == self.disk_index and entry.handle == old:
                    entry.handle = new
                    return True
                if entry.ssd_copy == old:
                    entry.ssd_copy = new
                    return True
            return False

    def forget(self, key: bytes, extent: DiskExtent) -> None:
        """Compaction found a record corrupt: whoever names it loses it (it is DEAD already).
        An entry being read back meanwhile is dropped by that read (a stale extent)."""
        with self._cond:
            for entry in self.index.any_with_key(key):
                if (
                    entry.tier == self.disk_index
                    and entry.handle == extent
                    and not entry.flags & MOVING
                ):
                    self.drop(entry, disk_already_dead=True)
                elif entry.ssd_copy == extent:
                    self.forget_copy(entry)  # its record is DEAD already
                    self.ssd.remove(entry.ns.tenant_salt, extent.span)

    def disk(self) -> DiskTier | None:
        if self.disk_index is None:
            return None
        disk = self.tiers[self.disk_index]
        assert isinstance(disk, DiskTier)
        return disk

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every SSD write queued so far has completed and been indexed."""
        disk = self.disk()
        if disk is None:
            return
        disk.flush()
        deadline = time.monotonic() + timeout
        with self._cond:  # the index switches in the writer's completion callback
            while any(self.pending_demotion):
                self.wait(deadline, "SSD demotions did not complete")

    def wait(self, deadline: float | None, what: str) -> None:
        if getattr(self.nonblocking, "on", False):
            raise WouldBlockError(what)
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceededError(f"timed out: {what}")
        self._cond.wait(remaining if remaining is not None else 1.0)


def encode_meta(entry: Entry, fmt: str = codec.NATIVE) -> bytes:
    """The SSD record's metadata: enough to re-index (and decode) the object after a
    restart. ``fmt`` appears only for fp8 records: native ones read as they always did."""
    ns = entry.ns
    meta = {
        "v": 1,
        "parent": entry.parent,
        "tokens": entry.num_tokens,
        "model": ns.model_id,
        "tenant": ns.tenant_salt,
        "lora": ns.lora_id,
        "spec": ns.spec.to_dict(),
    }
    if fmt != codec.NATIVE:
        meta["fmt"] = fmt
    packed: bytes = msgpack.packb(meta)
    return packed


def decode_meta(raw: bytes) -> tuple[Namespace, bytes, int, str]:
    meta = msgpack.unpackb(raw)
    if not isinstance(meta, dict) or meta.get("v") != 1:
        raise ValueError("unknown metadata version")
    spec = KVSpec.from_dict(meta["spec"])
    ns = Namespace(meta["model"], spec, meta["tenant"], meta["lora"])
    parent = meta["parent"]
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ValueError("bad parent key")
    spec.layout(meta["tokens"])
    fmt = meta.get("fmt", codec.NATIVE)
    if fmt not in codec.FORMATS:
        raise ValueError(f"unknown payload format {fmt!r}")
    return ns, parent, int(meta["tokens"]), fmt
