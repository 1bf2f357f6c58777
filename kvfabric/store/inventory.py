"""The store's inventory feed: who is told when complete objects are stored, move or leave.

:class:`InventoryFeed` keeps the listeners registered through
:meth:`TieredStore.add_inventory_listener <kvfabric.store.store.TieredStore.add_inventory_listener>`
and turns index entries into what they see (:data:`~kvfabric.store.protocol.StoredObject`,
:data:`~kvfabric.store.protocol.RemovedObject`, with tier names). Its :meth:`~InventoryFeed.changed`
is placement's ``inventory_changed`` hook; the leases call :meth:`~InventoryFeed.completed` on
a completed write, and the store :meth:`~InventoryFeed.begun` / the leases
:meth:`~InventoryFeed.abandoned` for the listeners that follow writes in flight.

Thread rules: every method runs under the store lock (the caller holds it), so listeners see
changes in the order they happened, on whichever thread made them. A listener must be quick
and must not call the store; an exception it raises is logged and ignored, so that the
store's own work completes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvfabric.store.index import Entry, LocalIndex
from kvfabric.store.protocol import InventoryListener, RemovedObject, StoredObject

log = logging.getLogger(__name__)


class InventoryFeed:
    """Inventory listeners, and the store's complete objects as they see them."""

    def __init__(self, names: Sequence[str], index: LocalIndex) -> None:
        self._names = names
        self._index = index
        self._listeners: list[InventoryListener] = []
        self._in_flight: list[InventoryListener] = []  # also told of objects being written

    def add(self, callback: InventoryListener, *, replay: bool, in_flight: bool = False) -> None:
        """Register ``callback``; with ``replay``, first report the current inventory to it
        as stored (atomically with the registration: the caller holds the lock). With
        ``in_flight`` it also hears of an object when its write begins (as stored: lookups
        already count it, and readers get its layers as they are committed) and when a
        write is abandoned (as removed), and not again when it completes."""
        self._listeners.append(callback)
        if in_flight:
            self._in_flight.append(callback)
        if replay:
            self._call(callback, self.snapshot(), [])

    def begun(self, entry: Entry) -> None:
        """A new object's write began (it is in the index, not complete)."""
        for callback in self._in_flight:
            self._call(callback, [self._stored(entry)], [])

    def completed(self, entry: Entry) -> None:
        """An object's last layer landed: news to the listeners that do not follow writes."""
        stored = [self._stored(entry)]
        for callback in self._listeners:
            if callback not in self._in_flight:
                self._call(callback, stored, [])

    def abandoned(self, entry: Entry) -> None:
        """An object's write ended without completing it (aborted, expired, deleted)."""
        for callback in self._in_flight:
            self._call(callback, [], [(entry.ns, entry.key, self._names[entry.tier])])

    def snapshot(self) -> list[StoredObject]:
        """Every complete object as a :class:`StoredObject`."""
        return [self._stored(e) for e in self._index.entries() if e.complete]

    def _stored(self, e: Entry) -> StoredObject:
        return StoredObject(e.ns, e.key, e.parent, e.num_tokens, self._names[e.tier], e.tokens)

    def changed(self, stored: list[Entry], removed: list[tuple[Entry, int]]) -> None:
        """Complete objects were stored or moved (``stored``, in their new tier) or left a
        tier (``removed``, with that tier's index): tell every listener."""
        if not self._listeners:
            return
        stored_out = [self._stored(e) for e in stored]
        removed_out = [(e.ns, e.key, self._names[tier]) for e, tier in removed]
        for callback in self._listeners:
            self._call(callback, stored_out, removed_out)

    def _call(
        self, callback: InventoryListener, stored: list[StoredObject], removed: list[RemovedObject]
    ) -> None:
        try:
            callback(stored, removed)
        except Exception:  # a listener bug must not leave a store operation half done
            log.exception("inventory listener failed")
