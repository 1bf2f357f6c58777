"""In-process global index: the single-node default, and the reference for the Redis backend.

:class:`EmbeddedState` plays the server (registry, chunk owners, event stream) and
:class:`EmbeddedIndex` the per-node client, so several "nodes" in one process (tests, a
single-box deployment with several daemons' worth of tiers) share one state. Semantics match
:mod:`kvfabric.cluster.index` exactly, except that the backend is never unavailable, so
:attr:`EmbeddedIndex.stale` is always false. Leases use the monotonic clock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvfabric.cluster import events as codec
from kvfabric.cluster.index import (
    BatchingIndex,
    ChunkRecord,
    GlobalLookup,
    IndexSnapshot,
    KVEvent,
    LiveRegistration,
    Location,
    NodeInfo,
    Update,
    check_key,
    parse_stream_id,
    refuse_duplicate,
)
from kvfabric.errors import LeaseExpiredError, SpecError, UnavailableError

Owner = tuple[str, int, str]  # (node_id, epoch, tier)


class EmbeddedState:
    """Shared in-process index state; all access under one lock."""

    def __init__(self, lease_ttl: float = 10.0, max_events: int = 100_000) -> None:
        if lease_ttl <= 0 or max_events <= 0:
            raise SpecError("lease_ttl and max_events must be positive")
        self.lease_ttl = lease_ttl
        self.cond = threading.Condition()
        self.nodes: dict[str, tuple[NodeInfo, float]] = {}  # node -> (info, lease deadline)
        self.epochs: dict[str, int] = {}  # last epoch handed out per node id
        self.chunks: dict[tuple[bytes, bytes], dict[Owner, None]] = {}
        self.meta: dict[tuple[bytes, bytes], tuple[bytes, int]] = {}  # parent, num_tokens
        self.events: deque[tuple[tuple[int, int], KVEvent]] = deque(maxlen=max_events)
        self._last_id = (0, 0)

    def live_epoch(self, node_id: str, now: float) -> int | None:
        entry = self.nodes.get(node_id)
        return entry[0].epoch if entry is not None and entry[1] > now else None

    def append_event(self, event: KVEvent) -> None:
        """Caller holds the lock. Ids follow Redis's '<ms>-<seq>' rule: strictly increasing."""
        ms = int(time.time() * 1000)
        last_ms, last_seq = self._last_id
        new = (ms, 0) if ms > last_ms else (last_ms, last_seq + 1)
        self._last_id = new
        self.events.append((new, replace(event, stream_id=f"{new[0]}-{new[1]}")))
        self.cond.notify_all()

    @property
    def last_id(self) -> str:
        return f"{self._last_id[0]}-{self._last_id[1]}"


class EmbeddedIndex(BatchingIndex):
    """One node's handle on an :class:`EmbeddedState` (a private one by default)."""

    def __init__(
        self,
        state: EmbeddedState | None = None,
        *,
        flush_interval: float = 0.005,
        max_batch: int = 4096,
    ) -> None:
        self._state = state or EmbeddedState()
        self._info: NodeInfo | None = None
        super().__init__(flush_interval=flush_interval, max_batch=max_batch)

    @property
    def stale(self) -> bool:
        return False

    def register(self, info: NodeInfo, *, takeover_after_s: float = 0.0) -> NodeInfo:
        st = self._state
        if self._info is None or self._info.node_id != info.node_id:  # not a re-register
            refuse_duplicate(info, lambda: self._live_registration(info.node_id), takeover_after_s)
        with st.cond:
            epoch = st.epochs.get(info.node_id, 0) + 1
            st.epochs[info.node_id] = epoch
            self._info = replace(info, epoch=epoch)
            st.nodes[info.node_id] = (self._info, time.monotonic() + st.lease_ttl)
        return self._info

    def _live_registration(self, node_id: str) -> LiveRegistration | None:
        st = self._state
        with st.cond:
            entry = st.nodes.get(node_id)
            if entry is None or entry[1] <= time.monotonic():
                return None
            return LiveRegistration(entry[0].address, entry[0].epoch, entry[1])

    def heartbeat(self) -> None:
        info = self._require_info()
        st = self._state
        with st.cond:
            if st.epochs.get(info.node_id) != info.epoch:
                raise LeaseExpiredError(f"node {info.node_id} epoch {info.epoch} was replaced")
            st.nodes[info.node_id] = (info, time.monotonic() + st.lease_ttl)

    def nodes(self) -> list[NodeInfo]:
        st = self._state
        now = time.monotonic()
        with st.cond:
            return [info for info, deadline in st.nodes.values() if deadline > now]

    def republish(self, inventory: Iterable[ChunkRecord]) -> None:
        info = self._require_info()
        self._discard_pending()
        self.register(replace(info, epoch=0))
        self.publish(stored=list(inventory))
        self.flush()

    def lookup(self, seed: bytes, keys: Sequence[bytes]) -> GlobalLookup:
        check_key("namespace seed", seed)
        st = self._state
        now = time.monotonic()
        owners: list[tuple[Location, ...]] = []
        with st.cond:
            live: dict[str, int | None] = {}
            for key in keys:
                holders = st.chunks.get((seed, key))
                row: list[Location] = []
                for node, epoch, tier in list(holders or ()):
                    if node not in live:
                        live[node] = st.live_epoch(node, now)
                    if live[node] == epoch:
                        row.append(Location(node, epoch, tier))
                    elif live[node] is not None and live[node] > epoch:  # type: ignore[operator]
                        self._drop_owner(seed, key, (node, epoch, tier))  # superseded: clean up
                if not row:
                    break
                owners.append(tuple(row))
        return GlobalLookup(len(keys), tuple(owners))

    def events(self, after_id: str = "0-0", block_ms: int = 0, count: int = 1000) -> list[KVEvent]:
        after = parse_stream_id(after_id)
        st = self._state
        deadline = time.monotonic() + block_ms / 1000
        with st.cond:
            while True:
                found = [ev for ident, ev in st.events if ident > after][:count]
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return found
                st.cond.wait(left)

    def snapshot(self) -> IndexSnapshot:
        st = self._state
        now = time.monotonic()
        out: list[KVEvent] = []
        with st.cond:
            for (seed, key), holders in st.chunks.items():
                parent, tokens = st.meta[(seed, key)]
                for node, epoch, tier in holders:
                    if st.live_epoch(node, now) == epoch:
                        out.append(
                            KVEvent("stored", (key,), tier, node, epoch, seed.hex(), parent, tokens)
                        )
            return IndexSnapshot(st.last_id, tuple(out))

    def first_event_id(self) -> str:
        st = self._state
        with st.cond:
            if not st.events:
                return "0-0"
            ms, seq = st.events[0][0]
            return f"{ms}-{seq}"

    def close(self) -> None:
        self._stop_flusher()

    def _send(self, batch: list[Update]) -> None:
        info = self._info
        if info is None:
            raise UnavailableError("publish before register(): updates dropped")
        st = self._state
        with st.cond:
            for kind, rec in batch:
                owner = (info.node_id, info.epoch, rec.tier)
                if kind == "stored":
                    st.chunks.setdefault((rec.seed, rec.key), {})[owner] = None
                    st.meta[(rec.seed, rec.key)] = (rec.parent, rec.num_tokens)
                else:
                    self._drop_owner(rec.seed, rec.key, owner)
            for event in codec.batch_events(batch, info.node_id, info.epoch):
                st.append_event(event)

    def _drop_owner(self, seed: bytes, key: bytes, owner: Owner) -> None:
        st = self._state
        holders = st.chunks.get((seed, key))
        if holders is not None:
            holders.pop(owner, None)
            if not holders:
                del st.chunks[(seed, key)]
                del st.meta[(seed, key)]

    def _require_info(self) -> NodeInfo:
        if self._info is None:
            raise SpecError("call register() first")
        return self._info
