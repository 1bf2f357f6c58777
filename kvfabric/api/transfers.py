"""Recent transfers: a bounded ring of the KV moves this daemon made, for operators' eyes
(``GET /v1/transfers/recent``, the ``/ui`` status page).

The Prometheus counters say how much moved; this says what moved last, and between whom.
One entry per operation that moved KV:

* ``get`` / ``put``: a control request of a local engine that pinned chunks for reading
  (``get``, ``get_batch``) or reserved them for writing (``reserve``, ``reserve_batch``);
  the engine copies the bytes itself through shared memory, so these carry no duration;
* ``serve``: chunks pinned here for another node's puller (``peer_pin``);
* ``pull`` / ``push``: a prefetch that copied chunks here from another node, a push of
  chunks to one, with how long the daemon's move took and the chunks it could not move.

It lives beside :class:`~kvfabric.api.metrics.Metrics` for the same reason: the server's
planes write into it and the HTTP API reads it, and the API may not import the server.

Bounded: the ring keeps the last ``capacity`` entries, so a busy node's memory does not
grow; ``recorded`` counts every entry ever made, so a reader can tell how many it missed.
Thread-safe: the control loop, request threads and the HTTP thread share one ring. A record
is a plain tuple appended under a lock (1-2 us; a frozen dataclass per record cost several
times that, on the control loop); :class:`Transfer` objects are made only when read.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, TypeAlias

DEFAULT_CAPACITY = 256

TransferKind = Literal["get", "put", "serve", "pull", "push"]
# Transfer's fields after seq, which is implied by the position in the ring
_Entry: TypeAlias = tuple[float, TransferKind, str, int, int | None, int | None, int, float | None]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One recorded move (see the module docstring). ``None``: not known for this kind."""

    seq: int  # 1 for the daemon's first entry, then consecutive
    at: float  # time.time() when it was recorded (the move's end)
    kind: TransferKind
    peer: str  # the engine (its session's client name) or the other node; "" when unknown
    chunks: int  # chunks moved
    nbytes: int | None = None
    tokens: int | None = None
    failed: int = 0  # chunks asked for but not moved (pull: found nowhere; push: refused)
    seconds: float | None = None  # pull, push: the daemon's own move


class RecentTransfers:
    """The last ``capacity`` transfers, oldest evicted first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self._ring: deque[_Entry] = deque(maxlen=capacity)
        self._recorded = 0  # also the seq of the newest entry
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    @property
    def recorded(self) -> int:
        """Entries made since start, evicted ones included."""
        return self._recorded

    def record(
        self,
        kind: TransferKind,
        peer: str,
        chunks: int,
        *,
        nbytes: int | None = None,
        tokens: int | None = None,
        failed: int = 0,
        seconds: float | None = None,
    ) -> None:
        entry = (time.time(), kind, peer, chunks, nbytes, tokens, failed, seconds)
        with self._lock:  # the count and the ring move together: seqs follow positions
            self._recorded += 1
            self._ring.append(entry)

    def recent(self, limit: int | None = None) -> tuple[list[Transfer], int]:
        """The newest ``limit`` entries (all kept: None), newest first, and ``recorded``."""
        with self._lock:
            kept = list(self._ring)
            recorded = self._recorded
        kept.reverse()
        if limit is not None:
            del kept[limit:]
        return [Transfer(recorded - i, *entry) for i, entry in enumerate(kept)], recorded
