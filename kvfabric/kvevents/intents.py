"""Writes an engine announced before it reserved them: routers hear of a prompt when its
engine admits it, not only once its first layer is computed.

A router fed by events credits only what it has heard of. The store announces a write when
it is reserved (:mod:`kvfabric.kvevents.log`), which an engine's connector does after the
first layer of the step that computes the chunk; a repeat of the prompt that reaches the
router before then goes elsewhere and computes the prefix again. An engine's scheduler
knows earlier, when it looks the prompt up (the ``intend`` op): the chunks it will compute
are announced from then on, as stored in the tier new writes land in.

An intent lasts ``ttl_s``. It ends silently when the store holds the chunk by then (the
write happened, in flight or complete: the store's own changes speak for it from there);
otherwise it is withdrawn (``BlockRemoved``). Chunks the store holds, or an intent already
covers, are not announced again. At most ``capacity`` intents are kept: more are refused
(counted), never evicting older ones.

Every chunk's token ids must hash to its key (:func:`kvfabric.hashing.verify_chunk_tokens`)
so that a client cannot make the node announce blocks that are not its own prompt's.

Thread-safe (one lock, never held while calling the change log or the store); a thread of
its own withdraws lapsed intents every ``ttl_s / 4``; :meth:`Intents.close` stops it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfabric.hashing import verify_chunk_tokens
from kvfabric.kvevents.log import ChangeLog
from kvfabric.spec import Namespace
from kvfabric.store.protocol import StoredObject

DEFAULT_TTL_S = 30.0
DEFAULT_CAPACITY = 65536


@dataclass(frozen=True)
class IntendedChunk:
    """A chunk an engine is about to compute: its key, parent, token count and token ids
    (int32-LE)."""

    key: bytes
    parent: bytes
    num_tokens: int
    tokens: bytes


class Intents:
    """Announced writes not reserved yet (see the module docstring)."""

    def __init__(
        self,
        changes: ChangeLog,
        holds: Callable[[Namespace, bytes], bool],
        tier: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or capacity < 1:
            raise ValueError("intents need a positive ttl and capacity")
        self._changes = changes
        self._holds = holds
        self._tier = tier
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._clock = clock
        # (namespace seed, key) -> (namespace, deadline); insertion order is deadline order
        self._pending: OrderedDict[tuple[bytes, bytes], tuple[Namespace, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.refused = 0  # intents past capacity
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvfabric-intents", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def announce(self, ns: Namespace, chunks: Sequence[IntendedChunk]) -> int:
        """Announce ``chunks`` of ``ns`` as being written; returns how many were announced
        (the others are held already, intended already, or past capacity). TokenMismatchError
        (nothing announced) when a chunk's tokens do not hash to its key."""
        for chunk in chunks:
            verify_chunk_tokens(ns, chunk.key, chunk.parent, chunk.num_tokens, chunk.tokens)
        fresh = [c for c in chunks if not self._holds(ns, c.key)]
        deadline = self._clock() + self._ttl_s
        announced: list[StoredObject] = []
        with self._lock:
            for chunk in fresh:
                slot = (ns.seed, chunk.key)
                if slot in self._pending:
                    continue
                if len(self._pending) >= self._capacity:
                    self.refused += 1
                    continue
                self._pending[slot] = (ns, deadline)
                announced.append(
                    StoredObject(
                        ns, chunk.key, chunk.parent, chunk.num_tokens, self._tier, chunk.tokens
                    )
                )
        if announced:
            self._changes.on_inventory(announced, [])
        return len(announced)

    def expire(self) -> int:
        """Withdraw the intents past their deadline whose chunk the store does not hold;
        returns how many were withdrawn."""
        now = self._clock()
        lapsed: list[tuple[Namespace, bytes]] = []
        with self._lock:
            while self._pending:
                (_, key), (ns, deadline) = next(iter(self._pending.items()))
                if deadline > now:
                    break
                self._pending.popitem(last=False)
                lapsed.append((ns, key))
        gone = [(ns, key, self._tier) for ns, key in lapsed if not self._holds(ns, key)]
        if gone:
            self._changes.on_inventory([], gone)
        return len(gone)

    def _run(self) -> None:
        while not self._stop.wait(self._ttl_s / 4):
            self.expire()
