"""The node's KV events for one namespace, page by page: what the ``kv_events`` op answers.

An engine connector (vLLM's ``take_events``) polls its daemon with the position it reached;
:meth:`NamespaceEvents.poll` answers the events of that namespace since then, in vLLM's
vocabulary for the engine's block size. The first poll (``after`` = -1), and any poll that
fell further behind than the change log holds, starts with a snapshot: ``AllBlocksCleared``
and every announceable object of the namespace. The session's namespace check (a tenant
reads only its own) is the caller's; this module sees one namespace at a time.

``intents`` (:mod:`kvfabric.kvevents.intents`) takes the ``intend`` op's announcements of
writes about to happen; None: the op is refused.

Thread-safe: the log is; the inventory is read through the store's snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfabric.kvevents.announce import Announcer
from kvfabric.kvevents.intents import Intents
from kvfabric.kvevents.log import ChangeLog
from kvfabric.spec import Namespace
from kvfabric.store.protocol import StoredObject

MAX_EVENTS_PER_POLL = 4096


@dataclass(frozen=True)
class NamespaceEvents:
    """The node's change log, its tiers' media and its inventory, read per namespace."""

    changes: ChangeLog
    medium_of_tier: Mapping[str, str]
    inventory: Callable[[], Iterable[StoredObject]]
    intents: Intents | None = None

    def poll(self, ns: Namespace, after: int, block_size: int, limit: int) -> dict[str, Any]:
        """``{"next": position for the next poll, "events": [...], "snapshot": bool}``;
        ``snapshot``: the events start with ``AllBlocksCleared`` and the namespace's whole
        inventory (at most ``limit`` objects of it: ``truncated``)."""
        seed = ns.seed
        announcer = Announcer(block_size, self.medium_of_tier, lambda n: n.seed == seed)
        limit = min(limit, MAX_EVENTS_PER_POLL)
        if after >= 0:
            read = self.changes.read(after, limit)
            if not read.gap:
                mine = [c for c in read.changes if c.ns.seed == seed]
                return {
                    "next": read.next_seq,
                    "events": announcer.events(mine),
                    "snapshot": False,
                }
        position = self.changes.next_seq  # before the snapshot: later changes follow it
        objects = [obj for obj in self.inventory() if obj.ns.seed == seed]
        events = announcer.snapshot(objects[:limit])
        return {
            "next": position,
            "events": events,
            "snapshot": True,
            "truncated": len(objects) > limit,
        }
