"""The store's leases: writers' reservations, readers' pins, their deadlines and quarantine.

:class:`Leases` issues the handles (:class:`~kvfabric.store.handles.ObjectWriter`,
:class:`~kvfabric.store.handles.ObjectReader`) for entries the store found or placed, and is
what they call back (it implements :class:`~kvfabric.store.handles.LeaseOwner`).

* Each committed layer renews a reservation for ``reservation_timeout_s`` (a writer
  streaming the layers of a forward pass that takes longer than that keeps its lease as long
  as it makes progress). The last layer completes the object: counted as a put, reported to
  the inventory feed, and the reservation ends.
* :meth:`~Leases.reclaim_expired` (the store's maintenance, and placement's ``reclaim``
  hook when a tier is full of leased objects): a reservation whose deadline passed is
  aborted, but its pages stay **quarantined** (taken, used by nothing) until the writer
  gives the lease back (:meth:`ObjectWriter.close`): a writer frozen past its deadline may
  still be copying into them. An expired pin is simply dropped: a late reader only reads
  (and is told its read may be torn).
* Layer listeners (:meth:`~Leases.add_layer_listener`) are called whenever a layer is
  committed or a write aborted.

Locking: :meth:`~Leases.new_writer`, :meth:`~Leases.pin`, :meth:`~Leases.abort_entry` and
:meth:`~Leases.reclaim_expired` are called with the store lock held; the handles' calls take
it. :meth:`~Leases.wait_layer` waits on the state's condition (WouldBlockError in the
nonblocking mode). Errors to handles: LeaseExpiredError (a commit after the deadline),
ObjectAbortedError (the object was deleted while being written, or its writer aborted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvfabric.errors import LeaseExpiredError, ObjectAbortedError
from kvfabric.memory.copy import Piece
from kvfabric.store.config import StoreConfig
from kvfabric.store.handles import ObjectReader, ObjectWriter, _Lease
from kvfabric.store.index import ABORTED, READY_ALL, REMOVED, Entry
from kvfabric.store.inventory import InventoryFeed
from kvfabric.store.placement import Placement
from kvfabric.store.shards import HeadRange
from kvfabric.store.state import StoreState
from kvfabric.store.tenants import Tenancy

log = logging.getLogger(__name__)


class Leases:
    """The open leases of the store, and the quarantined reservations."""

    def __init__(
        self,
        state: StoreState,
        config: StoreConfig,
        placement: Placement,
        tenancy: Tenancy,
        feed: InventoryFeed,
    ) -> None:
        self._state = state
        self._config = config
        self._placement = placement
        self._tenancy = tenancy
        self._feed = feed
        self.held: dict[int, _Lease] = {}
        # expired reservations whose writers have not given them back: pages held for them
        self.quarantined: dict[int, ObjectWriter] = {}
        self._layer_listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ issuing

    def new_writer(self, entry: Entry, heads: HeadRange | None) -> ObjectWriter:
        """A reservation of ``entry`` (of one head range, with ``heads``)."""
        mask = entry.shards.claim(heads) if heads is not None else 0
        self._tenancy.begin_write(entry.ns.tenant_salt)
        entry.pins += 1  # the writer's reservation
        writer = ObjectWriter(
            self,
            entry,
            time.monotonic() + self._config.reservation_timeout_s,
            heads=heads,
            head_mask=mask,
        )
        self.held[id(writer)] = writer
        return writer

    def pin(self, entry: Entry, lease_s: float | None) -> ObjectReader:
        """A reader of ``entry`` (in a memory tier), for ``lease_s`` (None: the default)."""
        state = self._state
        entry.pins += 1
        state.index.touch(entry)
        state.counters.gets += 1
        lease = self._config.pin_timeout_s if lease_s is None else lease_s
        reader = ObjectReader(self, entry, time.monotonic() + lease)
        self.held[id(reader)] = reader
        state.tier_counters[entry.tier].bytes_out += reader.nbytes
        return reader

    # ------------------------------------------------------------------ the handles' calls

    def tier_name(self, index: int) -> str:
        return self._state.names[index]

    def arena_id(self, entry: Entry) -> int | None:
        return self._tenancy.arena_id(entry.tier, entry.handle)

    def pieces(self, entry: Entry, offset: int, length: int) -> list[Piece]:
        return self._state.pieces(entry, offset, length)

    def commit_layers(self, writer: ObjectWriter, mask: int) -> bool:
        state = self._state
        with state.lock:
            if writer.expired:
                raise LeaseExpiredError(f"reservation of {writer.key.hex()} expired")
            entry = writer._entry
            if entry.flags & ABORTED:
                raise ObjectAbortedError(f"{writer.key.hex()} was deleted while being written")
            full = (1 << entry.ns.spec.num_layers) - 1
            writer.committed |= mask
            if entry.shards is None:
                ready = entry.ready | mask
            else:  # a layer is readable once every rank's heads of it landed
                ready = entry.ready | entry.shards.commit(writer.head_mask, mask)
            done = writer.committed == full
            if done:
                self._end(writer)
            else:  # progress renews the lease: a long forward pass keeps its reservation
                writer.deadline = max(
                    writer.deadline, time.monotonic() + self._config.reservation_timeout_s
                )
            if ready == full:
                entry.ready = READY_ALL
                entry.shards = None
                state.counters.puts += 1
                state.tier_counters[entry.tier].bytes_in += entry.ns.spec.layout(
                    entry.num_tokens
                ).nbytes
                self._feed.completed(entry)
            else:
                entry.ready = ready
            self._layers_changed()
            return done

    def abort(self, writer: ObjectWriter) -> None:
        with self._state.lock:
            if writer.closed or writer.expired:
                return
            self.abort_entry(writer._entry)
            self._end(writer)

    def unpin(self, reader: ObjectReader) -> None:
        with self._state.lock:
            if not reader.closed and not reader.expired:
                self._end(reader)

    def end_quarantine(self, writer: ObjectWriter) -> None:
        """The writer of an expired reservation gave it back: its pages may be reused."""
        with self._state.lock:
            if self.quarantined.pop(id(writer), None) is not None:
                self._end(writer)

    def layer_ready(self, entry: Entry, layer: int) -> bool:
        return entry.ready == READY_ALL or bool(entry.ready >> layer & 1)

    def wait_layer(self, entry: Entry, layer: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._state.lock:
            while not self.layer_ready(entry, layer):
                if entry.flags & ABORTED:
                    raise ObjectAbortedError(f"the writer of {entry.key.hex()} aborted")
                self._state.wait(deadline, f"layer {layer} of {entry.key.hex()} not committed")

    # ------------------------------------------------------------------ the store's calls

    def abort_entry(self, entry: Entry) -> None:
        """Abort an object being written (deleted, or its reservation expired)."""
        if not entry.flags & ABORTED:  # a delete, then the writer's own abort: one write
            entry.flags |= ABORTED
            self._state.counters.aborted += 1
        if not entry.complete and not entry.flags & REMOVED:
            self._feed.abandoned(entry)
        self._placement.drop(entry)
        self._layers_changed()

    def reclaim_expired(self, now: float) -> int:
        """Expire the leases whose deadline passed by ``now``; returns how many."""
        expired = [lease for lease in self.held.values() if lease.deadline <= now]
        for lease in expired:
            entry = lease._entry
            if isinstance(lease, ObjectWriter):
                if not entry.complete:
                    self.abort_entry(entry)
                # quarantined: its pin keeps the pages until the writer gives the lease back
                self.held.pop(id(lease), None)
                self.quarantined[id(lease)] = lease
                log.warning(
                    "reservation of %s expired; aborted, its pages quarantined until "
                    "the writer lets go",
                    entry.key.hex(),
                )
            else:
                log.warning("pin on %s expired; reclaimed", entry.key.hex())
                self._end(lease)
            lease.expired = True
        self._state.counters.expired += len(expired)
        if expired:
            self._state.cond.notify_all()
        return len(expired)

    def add_layer_listener(self, callback: Callable[[], None]) -> None:
        self._layer_listeners.append(callback)

    # ------------------------------------------------------------------ helpers

    def _end(self, lease: _Lease) -> None:
        lease.closed = True
        self.held.pop(id(lease), None)
        entry = lease._entry
        entry.pins -= 1
        if isinstance(lease, ObjectWriter):
            self._tenancy.end_write(entry.ns.tenant_salt)
        self._placement.free_if_dead(entry)

    def _layers_changed(self) -> None:
        self._state.cond.notify_all()
        for callback in self._layer_listeners:
            callback()
