"""Residency: which tier an object is in, the SSD record it may keep, and the end of its storage.

The bottom layer of placement. :class:`Residency` changes an entry's tier in the index
(:meth:`~Residency.rehome`), takes it out (:meth:`~Residency.drop`, counted as an eviction by
:meth:`~Residency.evict`), frees its storage once it is removed and unpinned
(:meth:`~Residency.free_if_dead`), and keeps the books of SSD records: the copies that
memory-resident objects keep (``Entry.ssd_copy``: an object read back from SSD keeps its
record, so a crash after the read still finds it) and the tenants' SSD bytes
(:class:`~kvfabric.store.ssd_usage.SsdUsage`, charged here and in
:mod:`kvfabric.store.disk_moves`).

Callers: :mod:`kvfabric.store.placement` and :mod:`kvfabric.store.disk_moves` (moves), and
:mod:`kvfabric.store.leases` (an aborted write is dropped, a released lease frees what it
held). Every method is called with the store lock held and never waits. Complete objects
that move or leave are reported through ``inventory_changed`` (a
:class:`~kvfabric.store.state.PlacementHooks` callback), under the lock.
"""

from __future__ import annotations

from typing import Any

from kvfabric.store.index import FP8_COPY, MOVING, REMOVED, Entry
from kvfabric.store.ssd_usage import SsdUsage
from kvfabric.store.state import InventoryChange, StoreState
from kvfabric.tiers.disk import DiskExtent, DiskTier


class Residency:
    """Index moves and removals of entries, and the SSD records they keep."""

    def __init__(
        self, state: StoreState, ssd: SsdUsage, inventory_changed: InventoryChange
    ) -> None:
        self._state = state
        self._inventory_changed = inventory_changed
        self.ssd = ssd  # tenants' SSD bytes (records queued or written)
        # memory-resident entries that keep an SSD record (Entry.ssd_copy), oldest first;
        # and the same per tenant with an SSD quota (it gives up its own first)
        self.copies: dict[Entry, None] = {}
        self.tenant_copies: dict[str, dict[Entry, None]] = {}

    def evict(self, entry: Entry) -> None:
        self._state.tier_counters[entry.tier].evictions += 1
        self.drop(entry)

    def drop(self, entry: Entry, *, disk_already_dead: bool = False) -> None:
        """Take an entry out of the index; its storage goes when the last pin does (an SSD
        copy at once: a crash must not bring back what was deleted or evicted)."""
        index = self._state.index
        was_listed = entry.complete and index.find(entry.ns, entry.key) is entry
        index.remove(entry)
        entry.flags |= REMOVED
        if entry.ssd_copy is not None:
            self.drop_copy(entry)
        if disk_already_dead and entry.tier == self._state.disk_index and entry.handle is not None:
            self.ssd.remove(entry.ns.tenant_salt, entry.handle.span)  # its record is DEAD
            entry.handle = None
        self.free_if_dead(entry)
        if was_listed:
            self._inventory_changed([], [(entry, entry.tier)])

    def rehome(self, entry: Entry, tier_index: int, handle: Any) -> None:
        """Move an entry to another tier in the index (and tell the inventory listeners)."""
        old = entry.tier
        self._state.index.move(entry, tier_index, handle)
        if old != tier_index and entry.complete and not entry.flags & REMOVED:
            self._inventory_changed([entry], [(entry, old)])

    def free_if_dead(self, entry: Entry) -> None:
        """Free a removed entry's storage, once nothing pins or moves it."""
        if not entry.flags & REMOVED or entry.pins or entry.flags & MOVING:
            return
        if entry.ssd_copy is not None:
            self.drop_copy(entry)
        if entry.handle is None:
            return
        tier = self._state.tiers[entry.tier]
        if isinstance(tier, DiskTier):
            self.delete_record(entry, entry.handle)
        else:
            tier.free(entry.handle)
        entry.handle = None

    # ------------------------------------------------------------------ SSD records

    def keep_copy(self, entry: Entry, extent: DiskExtent, *, fp8: bool) -> None:
        """Remember the SSD record of an entry that now lives in memory."""
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
        """Delete an entry's SSD copy; returns the record's span."""
        extent = self.forget_copy(entry)
        self.delete_record(entry, extent)
        return int(extent.span)

    def delete_record(self, entry: Entry, extent: DiskExtent) -> None:
        """Delete an SSD record of ``entry``'s object; its tenant is charged no more."""
        self._state.disk().delete(extent)  # type: ignore[union-attr]
        self.ssd.remove(entry.ns.tenant_salt, extent.span)
