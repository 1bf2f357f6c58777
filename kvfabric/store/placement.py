"""Placement: where objects live and how they move between tiers.

Allocation in the first memory tier with room; demotion of candidates (see
:mod:`kvfabric.store.index`) one tier down when a tier must make room or passes its high
watermark; promotion on hit; eviction from the last tier. :class:`Placement` does the moves
between memory tiers itself and hands the SSD's to :class:`~kvfabric.store.disk_moves.DiskMoves`
(write-behind demotion, read-back, quotas, compaction, recovery); both change the index
through :class:`~kvfabric.store.residency.Residency`, which also ends an object's storage
once it is removed and unpinned.

The seam with the store: the store's state (tiers, index, counters, lock) is a
:class:`~kvfabric.store.state.StoreState` that both use; the store calls the public methods
below, and placement calls the store back only through its
:class:`~kvfabric.store.state.PlacementHooks` (``reclaim`` when a tier is full of leased
objects, ``inventory_changed`` when complete objects move or leave).

Every method is called with the store lock held, except :meth:`Placement.finish_disk_promotion`,
:meth:`~Placement.flush` and :meth:`~Placement.compact`, which take it themselves and do
their SSD I/O outside it. Methods that may wait (for SSD demotions to free memory) do so on
the state's condition, which releases the lock, so an entry can change meanwhile: movers
mark it MOVING and re-check it afterwards. In the nonblocking mode such a wait raises
:class:`~kvfabric.errors.WouldBlockError`. Errors: CapacityError (no memory tier can make
room), QuotaExceededError (a tenant at its quota), DeadlineExceededError (room did not come
within ``reservation_timeout_s``), NotFoundError (a record read back was corrupt or gone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvfabric.errors import CapacityError, QuotaExceededError
from kvfabric.memory.copy import copy_pieces
from kvfabric.spec import Namespace
from kvfabric.store.config import StoreConfig
from kvfabric.store.disk_moves import DiskMoves
from kvfabric.store.index import MOVING, REMOVED, Entry
from kvfabric.store.residency import Residency
from kvfabric.store.ssd_usage import SsdUsage
from kvfabric.store.state import PlacementHooks, StoreState
from kvfabric.tiers.base import PagedTier
from kvfabric.tiers.disk import DiskExtent
from kvfabric.tiers.host import HostTier


class Placement:
    """Tier placement and movement of the store's objects."""

    def __init__(
        self, state: StoreState, config: StoreConfig, hooks: PlacementHooks, ssd: SsdUsage
    ) -> None:
        """``ssd``: the tenants' SSD quotas (their bytes are counted from here on)."""
        self._state = state
        self._config = config
        self._reclaim = hooks.reclaim
        self._residency = Residency(state, ssd, hooks.inventory_changed)
        self._disk = DiskMoves(state, config, self._residency)
        self._draining = [False] * len(state.tiers)

    def allocate(self, nbytes: int, tenant: str = "") -> tuple[int, Any]:
        """Pages for an object of ``tenant`` (its pool, in the tenant's arenas where it has
        them) in the first memory tier that can make room; CapacityError otherwise
        (QuotaExceededError when a tier refused because the tenant is at its quota there)."""
        errors = []
        quota = False
        for tier_index in self._state.paged:
            tier = self._state.tiers[tier_index]
            try:
                self.make_room(tier_index, nbytes, tenant)
                return tier_index, tier.allocate(nbytes, tier.pool_of(tenant))  # type: ignore
            except CapacityError as exc:
                quota = quota or isinstance(exc, QuotaExceededError)
                errors.append(f"{self._state.names[tier_index]}: {exc}")
        error = QuotaExceededError if quota else CapacityError
        raise error(f"no memory tier can hold {nbytes} bytes ({'; '.join(errors)})")

    def make_room(self, tier_index: int, nbytes: int, tenant: str = "") -> None:
        """Free pages in ``tier_index`` for ``nbytes`` of ``tenant``: a tenant whose own pool
        is full (its quota) demotes its own objects, and only those; otherwise victims are
        the tier's least recently used."""
        tier = self._state.tiers[tier_index]
        assert isinstance(tier, PagedTier)
        if nbytes > tier.capacity_bytes:
            raise CapacityError(f"object of {nbytes} bytes is larger than the tier")
        pool = tier.pool_of(tenant)
        reclaimed = False
        deadline = time.monotonic() + self._config.reservation_timeout_s
        # a tenant at its quota (a full pool as large as the tier is a full tier, below)
        if (
            pool is not None
            and tier.pool_bytes(pool) < tier.capacity_bytes
            and not tier.pool_can_fit(nbytes, pool)
        ):
            self.make_room_in_pool(tier_index, nbytes, tenant, deadline)
        while not tier.can_fit(nbytes, pool):
            pending = self._state.pending_demotion[tier_index]
            if pending and (pending >= nbytes or tier.can_fit(nbytes - pending)):
                # the SSD writes under way free enough: demoting more would only be churn
                # (can_fit(1) on a full tier, as before, demoted the whole tier at once)
                self._state.wait(deadline, "waiting for SSD demotions to free memory")
                continue
            victim = self._state.index.pick_victim(tier_index)
            if victim is not None:
                self.demote(victim)
            elif self._state.pending_demotion[tier_index]:
                self._state.wait(deadline, "waiting for SSD demotions to free memory")
            elif not reclaimed:
                reclaimed = True  # a dead client's leases may be what holds the memory
                self._reclaim()
            else:
                raise CapacityError(
                    f"{self._state.names[tier_index]} is full of pinned or incomplete objects"
                )

    def make_room_in_pool(self, tier_index: int, nbytes: int, tenant: str, deadline: float) -> None:
        """A tenant at its quota of a tier: demote its own objects there until its pool has
        the pages; QuotaExceededError when none can move."""
        tier = self._state.tiers[tier_index]
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
                self._state.wait(deadline, "waiting for the tenant's SSD demotions to free memory")
                continue
            victim = self._state.index.pick_victim(tier_index, tenant)
            if victim is not None:
                self.demote(victim)
                in_flight.append(victim)
            elif in_flight:
                self._state.wait(deadline, "waiting for the tenant's SSD demotions to free memory")
            elif not reclaimed:
                reclaimed = True  # its own stale leases may be what holds its memory
                self._reclaim()
            else:
                raise QuotaExceededError(
                    f"tenant {tenant!r} holds its whole quota of {self._state.names[tier_index]} "
                    f"({tier.pool_bytes(pool)} bytes) in objects that cannot move (being "
                    f"written, read, or quarantined)"
                )

    def demote(self, entry: Entry) -> None:
        """Move a victim to the next lower tier that can take it (the SSD always can, by
        evicting its own leaves), or evict it when none can (lock held)."""
        src_index = entry.tier
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        for dst_index in range(src_index + 1, len(self._state.tiers)):
            if dst_index == self._state.disk_index:
                self._disk.demote_to_disk(entry, nbytes)
                return
            try:
                pages = self.claim_pages(entry, dst_index, nbytes)
            except CapacityError:
                if entry.tier != src_index or entry.pins or entry.flags & REMOVED:
                    self._residency.free_if_dead(entry)
                    return  # read, moved or deleted meanwhile: no longer this mover's
                continue  # that tier is full of pinned or moving objects: try the next
            if pages is not None:
                self.move_in_memory(entry, dst_index, pages, nbytes)
                self._state.tier_counters[src_index].demotions += 1
            return
        self.evict(entry)  # nowhere below has room: this is the one that goes

    def promote_in_memory(self, entry: Entry) -> None:
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        src_index = entry.tier
        try:
            pages = self.claim_pages(entry, self._state.paged[0], nbytes)
        except CapacityError:
            return  # served from where it is
        if pages is not None:
            self._state.tier_counters[src_index].promotions += 1
            self.move_in_memory(entry, self._state.paged[0], pages, nbytes)

    def claim_pages(self, entry: Entry, tier_index: int, nbytes: int) -> Any | None:
        """Pages in ``tier_index`` to move ``entry`` into, or None if it changed meanwhile.

        Making room may wait (the lock is released), so the entry is marked MOVING to keep
        other movers off it, and re-checked afterwards: a reader that pinned it, or a delete,
        wins over the move.
        """
        src_index = entry.tier
        tier, tenant = self._state.tiers[tier_index], entry.ns.tenant_salt
        entry.flags |= MOVING
        try:
            self.make_room(tier_index, nbytes, tenant)
            pages = tier.allocate(nbytes, tier.pool_of(tenant))  # type: ignore[union-attr]
        finally:
            entry.flags &= ~MOVING
        if entry.flags & REMOVED or entry.tier != src_index or entry.pins:
            self._state.tiers[tier_index].free(pages)  # type: ignore[union-attr]
            self._residency.free_if_dead(entry)
            return None
        return pages

    def move_in_memory(self, entry: Entry, dst_index: int, pages: Any, nbytes: int) -> None:
        src = self._state.tiers[entry.tier]
        dst = self._state.tiers[dst_index]
        assert isinstance(src, PagedTier) and isinstance(dst, PagedTier)
        copy_pieces(dst.pieces(pages, 0, nbytes), src.pieces(entry.handle, 0, nbytes))
        old = entry.handle
        self._residency.rehome(entry, dst_index, pages)
        src.free(old)

    def start_disk_promotion(self, entry: Entry) -> tuple[int, Any]:
        """Mark an SSD entry MOVING and allocate memory for it: (tier index, pages) for
        :meth:`finish_disk_promotion`, which reads it in without the lock."""
        nbytes = entry.ns.spec.layout(entry.num_tokens).nbytes
        entry.flags |= MOVING  # first: allocating may wait, and other readers must wait too
        try:
            return self.allocate(nbytes, entry.ns.tenant_salt)
        except BaseException:
            entry.flags &= ~MOVING
            self._residency.free_if_dead(entry)
            self._state.cond.notify_all()
            raise

    def drain_to_low_watermark(self, tier_index: int) -> None:
        """Hysteresis: once a tier passes the high watermark, demote until the low one."""
        tier = self._state.tiers[tier_index]
        cap = tier.capacity_bytes
        used = tier.used_bytes - self._state.pending_demotion[tier_index]
        if used > self._config.high_watermark * cap:
            self._draining[tier_index] = True
        while self._draining[tier_index]:
            if (
                tier.used_bytes - self._state.pending_demotion[tier_index]
                <= self._config.low_watermark * cap
            ):
                self._draining[tier_index] = False
                return
            victim = self._state.index.pick_victim(tier_index)
            if victim is None:
                return  # the rest is pinned, moving or waiting on its children: next pass
            self.demote(victim)

    def spill(self) -> int:
        """Demote every complete, unpinned object from memory down to the SSD tier (so a
        restart finds it); returns how many moves were made. With the SSD full, the usual
        rule applies: its leaves are evicted for the (hotter) objects coming down."""
        if self._state.disk_index is None:
            return 0
        moves = 0
        # a move that makes no progress cannot loop forever
        budget = 3 * len(self._state.index) + 16
        while budget > 0:
            moved_now = 0
            for tier_index in self._state.paged:
                while budget > 0 and (victim := self._state.index.pick_victim(tier_index)):
                    self.demote(victim)
                    moved_now += 1
                    budget -= 1
            moves += moved_now
            if not moved_now:
                if not any(self._state.pending_demotion):
                    return moves
                # parents become candidates once their children's SSD writes land
                self._state.wait(time.monotonic() + 60, "spilling to SSD")
        return moves

    # ------------------------------------------------------------------ removal

    def evict(self, entry: Entry) -> None:
        """Drop an entry, counted as its tier's eviction."""
        self._residency.evict(entry)

    def drop(self, entry: Entry) -> None:
        """Take an entry out of the index (deleted or aborted); its storage goes with its
        last pin."""
        self._residency.drop(entry)

    def free_if_dead(self, entry: Entry) -> None:
        """A pin of ``entry`` ended: free its storage if it was removed meanwhile."""
        self._residency.free_if_dead(entry)

    def evict_unpinned(self, order: Sequence[int], nbytes: int | None) -> int:
        """Evict candidates of the tiers in ``order`` until ``nbytes`` are freed (None: all
        of them); returns how many were evicted."""
        evicted = freed = 0
        progress = True
        while progress and (nbytes is None or freed < nbytes):
            # a pass may turn parents into leaves (in this or an upper tier): go again
            progress = False
            for tier_index in order:
                while nbytes is None or freed < nbytes:
                    victim = self._state.index.pick_victim_for_eviction(tier_index)
                    if victim is None:
                        break
                    freed += victim.ns.spec.layout(victim.num_tokens).nbytes
                    self._residency.evict(victim)
                    evicted += 1
                    progress = True
        return evicted

    # ------------------------------------------------------------------ the SSD

    def finish_disk_promotion(
        self, entry: Entry, extent: DiskExtent, target: tuple[int, Any]
    ) -> None:
        """Read an SSD entry back into ``target`` (from :meth:`start_disk_promotion`),
        without the lock; NotFoundError if its record was corrupt or gone (dropped)."""
        self._disk.finish_disk_promotion(entry, extent, target)

    def flush(self, timeout: float) -> None:
        """Wait until every SSD write queued so far has completed and been indexed."""
        if self._state.disk_index is not None:
            self._disk.flush(timeout)

    def recover(self, intern: Callable[[Namespace], Namespace]) -> None:
        """Index the SSD's records at start (see :meth:`DiskMoves.recover`)."""
        if self._state.disk_index is not None:
            self._disk.recover(intern)

    def ssd_bytes_by_tenant(self) -> dict[str, int]:
        """Every configured tenant's bytes on the SSD tier."""
        return self._residency.ssd.by_tenant()

    # ------------------------------------------------------------------ maintenance

    def maintain(self) -> None:
        """Give free memory back to the OS, shrink the index's tables after a mass eviction
        (neither does it by itself), and demote or evict tiers above their high watermark."""
        for tier in self._state.tiers:
            if isinstance(tier, HostTier):
                tier.release_free_memory(int(self._config.free_memory_kept * tier.capacity_bytes))
        self._state.index.compact()
        for tier_index in self._state.paged:
            self.drain_to_low_watermark(tier_index)
        if self._state.disk_index is not None:
            self._disk.trim()

    def compact(self) -> None:
        """Compact the SSD tier's segments (without the lock)."""
        if self._state.disk_index is not None:
            self._disk.compact()
