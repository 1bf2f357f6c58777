"""The fabric's blocks in the engine's own KV event stream (``KVFabricConnector.take_events``).

An engine started with ``--kv-events-config`` publishes its prefix-cache blocks through
vLLM's publisher, and each scheduler step vLLM adds what the connector's ``take_events``
returns. :class:`EventRelay` makes that the blocks the node's fabric holds for this engine's
namespaces, in the engine's block size, with the medium of the tier they are in (``CPU``:
DRAM and CXL, ``STORAGE``: SSD, ``GPU``: a fabric device tier), stored and removed as the
fabric stores, moves and evicts them (:mod:`kvfabric.kvevents`). A router consuming the
engine's events (vllm-router's ``kv_aware``) thus credits a prompt the fabric can load,
weighed by its penalty for that medium.

How: a background thread polls the daemon (the ``kv_events`` op, through this engine's
token: a tenant's engine sees its tenant's namespaces only) every ``poll_s`` for each
namespace this engine has served (the base model's from the start; at most
``max_namespaces``, least recently used dropped), and queues the events; ``take_events``
only drains the queue, so the scheduler never waits on the daemon. The first poll of a
namespace returns its whole inventory. ``AllBlocksCleared`` from the daemon is not
forwarded: consumers would drop the engine's own GPU blocks with it. The daemon being down
costs nothing but events (polls back off with the link).

Thread rules: :meth:`watch` and :meth:`take` on the scheduler thread, the poller on its
own; a lock guards the shared state. :meth:`close` stops the thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvfabric.errors import KVFabricError, UnavailableError
from kvfabric.spec import Namespace
from kvfabric_connectors.link import DaemonLink

log = logging.getLogger(__name__)

_TYPES: dict[str, type[KVCacheEvent]] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
MAX_QUEUED = 1 << 16


class EventRelay:
    """Polls the daemon for the fabric's events of this engine's namespaces."""

    def __init__(
        self,
        link: DaemonLink,
        block_size: int,
        poll_s: float,
        *,
        max_namespaces: int = 64,
    ) -> None:
        self._link = link
        self._block_size = block_size
        self._poll_s = poll_s
        self._max_namespaces = max_namespaces
        self._positions: OrderedDict[Namespace, int] = OrderedDict()  # ns -> next position
        self._queue: list[KVCacheEvent] = []
        self._refused: set[Namespace] = set()  # namespaces whose poll failed (logged once)
        self.dropped = 0  # events not queued: the scheduler did not take them in time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfabric-events", daemon=True)
        self._thread.start()

    def watch(self, ns: Namespace) -> None:
        """Relay ``ns``'s events from now on (a request of this namespace was seen)."""
        with self._lock:
            if ns in self._positions:
                self._positions.move_to_end(ns)
                return
            self._positions[ns] = -1
            while len(self._positions) > self._max_namespaces:
                self._positions.popitem(last=False)

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._queue = self._queue, []
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                namespaces = list(self._positions.items())
            for ns, after in namespaces:
                if self._stop.is_set():
                    return
                self._poll(ns, after)

    def _poll(self, ns: Namespace, after: int) -> None:
        try:
            reply = self._link.client().kv_events(ns, after, self._block_size)
        except (UnavailableError, OSError) as exc:
            self._link.failed(exc)
            return
        except KVFabricError as exc:  # a daemon without the op, a namespace it refuses
            if ns not in self._refused:
                log.warning("kvfabric: no KV events for %s: %s", ns.model_id, exc)
                self._refused.add(ns)
            return
        events = [self._event(e) for e in reply["events"] if e.get("type") in _TYPES]
        with self._lock:
            if ns in self._positions:
                self._positions[ns] = int(reply["next"])
            room = MAX_QUEUED - len(self._queue)
            self._queue += events[:room]
            self.dropped += max(0, len(events) - room)

    @staticmethod
    def _event(raw: dict[str, Any]) -> KVCacheEvent:
        fields = {k: v for k, v in raw.items() if k != "type"}
        event: KVCacheEvent = msgspec.convert(fields, _TYPES[raw["type"]])
        return event
