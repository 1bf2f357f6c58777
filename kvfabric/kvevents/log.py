"""The node's inventory changes, numbered, in a bounded log that several readers follow.

:class:`ChangeLog` is a store inventory listener (``store.add_inventory_listener``). Every
complete object stored, moved or removed becomes a :class:`Change` with a sequence number
(registered ``in_flight``, as the daemon does, also an object whose write begins, and one
whose write is abandoned: lookups count an object from its reservation on);
the last ``capacity`` changes are kept. Readers (the node's ZMQ event stream, and the
``kv_events`` op that engine connectors poll) each keep their own position and call
:meth:`ChangeLog.read`; a reader that fell further behind than the log holds is told so
(``gap``) and resynchronises from a snapshot of the store (``store.inventory()``): events
are idempotent set operations, so a snapshot followed by the changes after any earlier
position converges to the store's state.

Only namespaces whose chunks carry token ids and split into whole blocks can be announced;
the log keeps every change regardless (removals of chunks never announced are harmless to
consumers), and :mod:`kvfabric.kvevents.announce` decides what to say.

Thread rules: :meth:`on_inventory` runs under the store's lock and only appends; readers run
on their own threads; one internal lock, never held while calling out.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from itertools import islice

from kvfabric.spec import Namespace
from kvfabric.store.protocol import RemovedObject, StoredObject


@dataclass(frozen=True)
class Change:
    """One object stored in (``stored``) or gone from (``removed``) a tier. ``tokens`` (the
    chunk's own token ids, int32-LE) only for stored objects whose writer gave them."""

    seq: int
    stored: bool
    ns: Namespace
    key: bytes
    tier: str
    parent: bytes = b""
    num_tokens: int = 0
    tokens: bytes | None = None


@dataclass(frozen=True)
class LogRead:
    """What :meth:`ChangeLog.read` returns: the changes after the reader's position, the new
    position (``next_seq``), and ``gap``: changes the reader never saw were dropped."""

    changes: list[Change]
    next_seq: int
    gap: bool


class ChangeLog:
    """The last ``capacity`` inventory changes of the node."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._changes: deque[Change] = deque(maxlen=capacity)
        self._next_seq = 0
        self._cond = threading.Condition()

    @property
    def next_seq(self) -> int:
        """The sequence number the next change will get (a reader starting now reads from it)."""
        with self._cond:
            return self._next_seq

    def on_inventory(self, stored: list[StoredObject], removed: list[RemovedObject]) -> None:
        """Store listener (under the store lock). Removals first: a move reports the object
        in its new tier and gone from its old one, and must end stored."""
        with self._cond:
            for ns, key, tier in removed:
                self._append(Change(self._next_seq, False, ns, key, tier))
            for obj in stored:
                self._append(
                    Change(
                        self._next_seq,
                        True,
                        obj.ns,
                        obj.key,
                        obj.tier,
                        obj.parent,
                        obj.num_tokens,
                        obj.tokens,
                    )
                )
            if stored or removed:
                self._cond.notify_all()

    def _append(self, change: Change) -> None:
        self._changes.append(change)
        self._next_seq += 1

    def read(self, after: int, limit: int, timeout: float = 0.0) -> LogRead:
        """Up to ``limit`` changes with ``seq >= after``; waits up to ``timeout`` seconds for
        the first one. ``after`` beyond the log's end is treated as its end."""
        with self._cond:
            if after >= self._next_seq and timeout > 0:
                self._cond.wait_for(lambda: self._next_seq > after, timeout)
            after = min(after, self._next_seq)
            oldest = self._next_seq - len(self._changes)
            gap = after < oldest
            start = max(after, oldest) - oldest
            # one walk of the deque (indexing it in a loop walks it once per item)
            out = list(islice(self._changes, start, start + limit))
            next_seq = out[-1].seq + 1 if out else max(after, oldest)
            return LogRead(out, next_seq, gap)
