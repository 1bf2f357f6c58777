"""Moves to and from the SSD tier: write-behind demotion, read-back, quotas, compaction, recovery.

:class:`DiskMoves` is placement's SSD half; :class:`~kvfabric.store.placement.Placement`
is its only caller (the store reaches it through Placement's methods).

* Demotion (:meth:`~DiskMoves.demote_to_disk`): the object's record is queued on the disk
  tier's writers and the entry marked MOVING; the object leaves memory only once the record
  is written (:meth:`~DiskMoves.finish_disk_demotion`, on a writer thread). An object that
  kept its SSD record (``Entry.ssd_copy``) returns to it without a write.
* Read-back (:meth:`~DiskMoves.finish_disk_promotion`): the record is read, checksum
  verified, into pages Placement allocated, outside the lock; the record stays as the
  entry's SSD copy. A corrupt or vanished record drops the entry (NotFoundError).
* A degraded SSD tier (a write fault: full disk, quota, I/O error) takes no demotions: the
  victim is evicted instead (counted in the source tier's evictions and the SSD tier's
  ``refused_demotions``), never turned into an error for the put that needed the room.
* Tenants' SSD quotas (:mod:`kvfabric.store.ssd_usage`): before a tenant's record is queued,
  its own SSD copies and then its own SSD leaves (oldest first) are given up until the
  record fits its quota; when they cannot make room the victim is evicted from memory
  instead (counted in the SSD tier's ``quota_refused_demotions``). A tenant with an SSD
  quota that finds the disk full makes room among its own records too, never others'.
  SSD copies go first (oldest promotion first) when the SSD needs space.
* Recovery (:meth:`~DiskMoves.recover`) re-indexes the records a restart finds, charging
  their tenants; compaction's callbacks (:meth:`~DiskMoves.relocate`,
  :meth:`~DiskMoves.forget`) follow moved records and drop corrupt ones.

Locking: called with the store lock held, except :meth:`~DiskMoves.finish_disk_promotion`,
:meth:`~DiskMoves.flush` and :meth:`~DiskMoves.compact` (which take it themselves around
the index work and do their I/O outside it) and the writers' completion callbacks (which
take it). :meth:`~DiskMoves.flush` waits on the store's condition (WouldBlockError in the
nonblocking mode).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvfabric.errors import CapacityError, CorruptRecordError, KVFabricError, NotFoundError
from kvfabric.memory.copy import Piece, copy_pieces, total_bytes
from kvfabric.spec import Namespace
from kvfabric.store import codec
from kvfabric.store.config import StoreConfig
from kvfabric.store.index import FP8_COPY, FP8_ON_DISK, MOVING, READY_ALL, REMOVED, Entry
from kvfabric.store.residency import Residency
from kvfabric.store.state import StoreState
from kvfabric.tiers.base import PagedTier
from kvfabric.tiers.disk import DiskExtent, DiskTier, StaleExtentError, TierDegradedError
from kvfabric.tiers.disk.records import record_span

log = logging.getLogger(__name__)


class DiskMoves:
    """Demotion to, read-back from, and the upkeep of the SSD tier (the last tier)."""

    def __init__(self, state: StoreState, config: StoreConfig, residency: Residency) -> None:
        self._state = state
        self._config = config
        self._residency = residency
        self._format = (
            codec.NATIVE if state.disk_index is None else config.tiers[state.disk_index].format
        )

    def _disk(self) -> DiskTier:
        disk = self._state.disk()
        assert disk is not None
        return disk

    # ------------------------------------------------------------------ demotion

    def demote_to_disk(self, entry: Entry, nbytes: int) -> None:
        """Queue a victim's record (or switch it to the record it kept, or evict it)."""
        state, residency = self._state, self._residency
        disk = self._disk()
        if entry.ssd_copy is not None:  # its record is still there: nothing to write
            self.return_to_copy(entry)
            return
        if disk.degraded:
            self.refuse_demotion(entry)
            return
        tenant = entry.ns.tenant_salt
        fmt = self._format if codec.encodable(entry.ns.spec) else codec.NATIVE
        meta = codec.encode_meta(entry, fmt)
        # its span before any byte is encoded (an fp8 payload's size follows from the spec)
        span = record_span(
            len(meta),
            codec.encoded_nbytes(entry.ns.spec, entry.num_tokens) if fmt == codec.FP8 else nbytes,
        )
        if not self.make_ssd_room(tenant, span):
            state.tier_counters[state.ssd_index].quota_refused_demotions += 1
            residency.evict(entry)
            return
        pieces = state.pieces(entry, 0, nbytes)
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
            self.evict_disk_leaves(nbytes, tenant if residency.ssd.limit(tenant) else None)
            residency.evict(entry)
            return
        residency.ssd.add(tenant, span)
        src_index = entry.tier
        entry.flags |= MOVING
        state.pending_demotion[src_index] += nbytes
        future.add_done_callback(
            lambda f: self.finish_disk_demotion(entry, src_index, nbytes, span, pieces, fmt, f)
        )

    def make_ssd_room(self, tenant: str, span: int) -> bool:
        """Whether a record of ``span`` bytes of ``tenant`` fits its SSD quota, once its own
        SSD copies and leaves (oldest first) are given up as far as needed (nothing is given
        up for a record larger than the whole quota)."""
        ssd = self._residency.ssd
        excess = ssd.excess(tenant, span)
        if excess <= 0:
            return True
        if span > (ssd.limit(tenant) or 0):
            return False
        self.evict_disk_leaves(excess, tenant)
        return ssd.excess(tenant, span) <= 0

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
        """A demotion's write completed (a writer thread): switch the entry to its record,
        or keep the record as a copy (read meanwhile), or delete it (removed meanwhile)."""
        state, residency = self._state, self._residency
        written = total_bytes(pieces)
        del pieces  # kept alive until the write completed
        with state.cond:
            state.pending_demotion[src_index] -= nbytes
            entry.flags &= ~MOVING
            error = future.exception()
            if error is not None:  # no record: the tenant is not charged for it
                residency.ssd.remove(entry.ns.tenant_salt, span)
            if isinstance(error, TierDegradedError):
                pass  # counted and logged (rate-limited) by the tier; the entry stays put
            elif error is not None:
                log.warning("SSD demotion of %s failed: %s", entry.key.hex(), error)
            elif entry.flags & REMOVED or entry.ssd_copy is not None:
                residency.delete_record(entry, future.result())  # deleted meanwhile
            elif entry.pins:
                residency.keep_copy(entry, future.result(), fp8=fmt == codec.FP8)  # hot again
            else:
                old = entry.handle
                residency.rehome(entry, state.ssd_index, future.result())
                if fmt == codec.FP8:
                    entry.flags |= FP8_ON_DISK
                state.tiers[src_index].free(old)  # type: ignore[union-attr]
                state.tier_counters[src_index].demotions += 1
                counters = state.tier_counters[state.ssd_index]
                counters.bytes_in += nbytes
                counters.bytes_saved += nbytes - written
            residency.free_if_dead(entry)
            state.cond.notify_all()

    def refuse_demotion(self, entry: Entry) -> None:
        """The SSD tier is degraded: the victim is evicted instead (both counted)."""
        self._state.tier_counters[self._state.ssd_index].refused_demotions += 1
        self._residency.evict(entry)

    def return_to_copy(self, entry: Entry) -> None:
        """Demote an entry to the SSD record it kept: a switch of handles, no write."""
        state = self._state
        src_index, old = entry.tier, entry.handle
        fp8 = bool(entry.flags & FP8_COPY)
        extent = self._residency.forget_copy(entry)
        self._residency.rehome(entry, state.ssd_index, extent)
        if fp8:
            entry.flags |= FP8_ON_DISK
        state.tiers[src_index].free(old)  # type: ignore[union-attr]
        state.tier_counters[src_index].demotions += 1

    def evict_disk_leaves(self, nbytes: int, tenant: str | None = None) -> None:
        """Free SSD records worth ``nbytes`` (of ``tenant``'s objects only, one with an SSD
        quota, when given): the copies of memory-resident objects first (nothing is lost),
        then SSD leaves, oldest first; compaction returns the space later."""
        residency = self._residency
        freed = 0
        copies = residency.copies if tenant is None else residency.tenant_copies.get(tenant, {})
        while freed < nbytes and copies:
            freed += residency.drop_copy(next(iter(copies)))
        while freed < nbytes:
            victim = self._state.index.pick_victim(self._state.ssd_index, tenant)
            if victim is None:
                return
            freed += victim.handle.span
            residency.evict(victim)

    # ------------------------------------------------------------------ read-back

    def finish_disk_promotion(
        self, entry: Entry, extent: DiskExtent, target: tuple[int, Any]
    ) -> None:
        """Read an SSD entry (marked MOVING) into ``target`` (tier index, pages) and switch
        it there; called without the lock. NotFoundError if its record is corrupt or gone
        (the entry is dropped); any other error leaves it on SSD."""
        state, residency = self._state, self._residency
        tier_index, pages = target
        tier = state.tiers[tier_index]
        assert isinstance(tier, PagedTier)
        disk = self._disk()
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
            with state.cond:
                entry.flags &= ~MOVING
                tier.free(pages)
                if lost:
                    residency.drop(entry, disk_already_dead=True)
                state.cond.notify_all()
            if lost:
                what = "corrupt" if isinstance(exc, CorruptRecordError) else "gone"
                raise NotFoundError(
                    f"{entry.key.hex()} was {what} on SSD and was dropped: {exc}"
                ) from None
            raise
        with state.cond:
            entry.flags &= ~MOVING
            if entry.flags & REMOVED:
                tier.free(pages)
                residency.free_if_dead(entry)
            else:
                # the record stays (compaction may have moved it: the current handle)
                residency.keep_copy(entry, entry.handle, fp8=bool(entry.flags & FP8_ON_DISK))
                residency.rehome(entry, tier_index, pages)
                entry.flags &= ~FP8_ON_DISK
                state.tier_counters[state.ssd_index].promotions += 1
                state.tier_counters[state.ssd_index].bytes_out += nbytes
            state.cond.notify_all()

    def read_disk_record(
        self, disk: DiskTier, entry: Entry, extent: DiskExtent, pieces: list[Piece]
    ) -> None:
        """Read an entry's record; if compaction moved it meanwhile, follow it."""
        for _ in range(3):
            try:
                disk.read_into(extent, pieces, key=entry.key)
                return
            except StaleExtentError:
                with self._state.cond:
                    if entry.handle == extent or entry.flags & REMOVED:
                        raise
                    extent = entry.handle
        disk.read_into(extent, pieces, key=entry.key)

    # ------------------------------------------------------------------ upkeep

    def trim(self) -> None:
        """Hysteresis on the SSD: past its high watermark, evict leaves (copies first)
        down to the low one (lock held)."""
        disk, config = self._disk(), self._config
        if disk.used_bytes > config.high_watermark * disk.capacity_bytes:
            live = disk.stats().live_bytes
            self.evict_disk_leaves(int(live - config.low_watermark * disk.capacity_bytes))

    def compact(self) -> None:
        """Compact the SSD's segments (without the lock: the callbacks take it)."""
        self._disk().compact(
            self.relocate, min_dead_ratio=self._config.compact_dead_ratio, forget=self.forget
        )

    def relocate(self, key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
        """Compaction moved a record: follow it (an SSD entry's handle, or a copy)."""
        with self._state.cond:
            for entry in self._state.index.any_with_key(key):
                if entry.tier == self._state.disk_index and entry.handle == old:
                    entry.handle = new
                    return True
                if entry.ssd_copy == old:
                    entry.ssd_copy = new
                    return True
            return False

    def forget(self, key: bytes, extent: DiskExtent) -> None:
        """Compaction found a record corrupt: whoever names it loses it (it is DEAD already).
        An entry being read back meanwhile is dropped by that read (a stale extent)."""
        with self._state.cond:
            for entry in self._state.index.any_with_key(key):
                if (
                    entry.tier == self._state.disk_index
                    and entry.handle == extent
                    and not entry.flags & MOVING
                ):
                    self._residency.drop(entry, disk_already_dead=True)
                elif entry.ssd_copy == extent:
                    self._residency.forget_copy(entry)  # its record is DEAD already
                    self._residency.ssd.remove(entry.ns.tenant_salt, extent.span)

    def flush(self, timeout: float) -> None:
        """Wait until every SSD write queued so far has completed and been indexed
        (DeadlineExceededError after ``timeout`` seconds)."""
        self._disk().flush()
        deadline = time.monotonic() + timeout
        with self._state.cond:  # the index switches in the writer's completion callback
            while any(self._state.pending_demotion):
                self._state.wait(deadline, "SSD demotions did not complete")

    def recover(self, intern: Callable[[Namespace], Namespace]) -> None:
        """Index the records found on the SSD at start (their tenants are charged for
        them); ``intern`` gives the store's namespace for a record's (see
        :meth:`kvfabric.store.namespaces.NamespaceTable.intern`). Unreadable metadata: the
        record is deleted."""
        disk, disk_index = self._disk(), self._state.ssd_index
        for record in disk.scan():
            try:
                meta = codec.decode_meta(record.meta)
            except (KVFabricError, ValueError, TypeError, KeyError) as exc:
                log.warning(
                    "SSD record %s has unreadable metadata (%s); dropped", record.key.hex(), exc
                )
                disk.delete(record.extent)
                continue
            entry = Entry(
                record.key,
                meta.parent,
                intern(meta.ns),
                meta.num_tokens,
                disk_index,
                record.extent,
                meta.tokens,
            )
            entry.ready = READY_ALL
            if meta.fmt == codec.FP8:
                entry.flags |= FP8_ON_DISK
            self._state.index.add(entry)
            # the record's metadata names its tenant: its SSD bytes survive the restart
            self._residency.ssd.add(meta.ns.tenant_salt, record.extent.span)
