"""The global index: which node holds which chunk, in which tier.

One interface, two backends: :class:`~kvfabric.cluster.embedded.EmbeddedIndex` (in-process,
single node, the default) and :class:`~kvfabric.cluster.redis_index.RedisGlobalIndex` (a real
Redis or Redis Cluster shared by every node and router).

Contract
--------
* **One instance per node** (a daemon), or per router. The node calls :meth:`register` once
  per start: that gives it a new **epoch**. Entries published under an older epoch of the same
  node are invisible to every reader from that moment on (a restarted node never shows its old
  inventory) and are cleaned up later. The node calls :meth:`heartbeat` more often than its
  lease TTL; once the lease expires, every reader ignores the node's entries at once.
* **Node ids are unique among live nodes.** A handle's first :meth:`register` of a node id
  whose lease is live under *another* address is refused with
  :class:`~kvfabric.errors.DuplicateNodeError` (two daemons configured with the same id, e.g.
  ``--node-id "$(hostname)"`` twice on one host), unless that lease is not renewed within
  ``takeover_after_s`` (its daemon is gone: a crash, then a restart on another port). The same
  address is a restart of the same node and takes over at once (:func:`refuse_duplicate`).
* **Writes are batched off the hot path.** :meth:`publish` only queues updates and never blocks
  on the backend nor raises because it is down; a background flusher sends them in batches
  (and appends one :class:`KVEvent` per chain run to the event stream). :meth:`flush` waits
  until everything queued so far was sent.
* **Reads are one round trip.** :meth:`lookup` answers the longest prefix of a whole chain that
  live nodes hold, with each chunk's owners, in one request.
* **Unavailability.** When the backend cannot be reached, reads (:meth:`lookup`,
  :meth:`nodes`, :meth:`events`, :meth:`snapshot`) raise
  :class:`~kvfabric.errors.UnavailableError` quickly (every network call has a timeout) and
  :attr:`stale` becomes true. The node keeps serving local hits and puts; its queued updates
  are superseded by :meth:`republish` of its whole inventory once the backend is back (the
  flusher does this by itself when given an ``inventory`` callback). Until then lookups that
  succeed carry ``stale=True``.
* **Events.** Every store/remove goes to an append-only stream with ordered string ids;
  :meth:`snapshot` returns the current live state plus the stream id it is consistent with, so a
  consumer can rebuild and then resume with :meth:`events` after that id. Applying an event is
  idempotent (stored = add (node, epoch, tier) to a chunk, removed = discard it), so replaying
  events already reflected in a snapshot converges to the same state.
* **Thread-safety.** Every method may be called from any thread.
* **Errors.** Bad arguments raise :class:`~kvfabric.errors.SpecError`; a heartbeat of an
  incarnation that a newer :meth:`register` replaced raises
  :class:`~kvfabric.errors.LeaseExpiredError`; nothing here raises a backend library's own
  exception type.
"""

from __future__ import annotations

import abc
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Self, TypedDict

from kvfabric.errors import (
    DeadlineExceededError,
    DuplicateNodeError,
    KVFabricError,
    SpecError,
    UnavailableError,
)
from kvfabric.hashing import KEY_BYTES, ROOT

EventKind = Literal["stored", "removed"]
Inventory = Callable[[], Iterable["ChunkRecord"]]

# Node ids and tier names end up inside Redis field names separated by '|': keep them plain.
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
MAX_LORA_BYTES = 4096  # as Namespace.lora_id


def check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise SpecError(f"{what} must be 1-128 characters of [A-Za-z0-9_.:-], got {value!r}")
    return value


def check_key(what: str, value: bytes) -> bytes:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        raise SpecError(f"{what} must be {KEY_BYTES} bytes")
    return value


@dataclass(frozen=True)
class NodeInfo:
    """A registered node. ``epoch`` is 0 until :meth:`GlobalIndex.register` assigns one."""

    node_id: str
    address: str
    tiers: tuple[str, ...] = ()
    hardware_class: str = ""
    transports: dict[str, str] = field(default_factory=dict, hash=False)
    epoch: int = 0

    def __post_init__(self) -> None:
        check_name("node_id", self.node_id)
        object.__setattr__(self, "tiers", tuple(check_name("tier", t) for t in self.tiers))


@dataclass(frozen=True)
class Location:
    """One copy of a chunk: on ``node_id`` (incarnation ``epoch``), in ``tier``."""

    node_id: str
    epoch: int
    tier: str


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk a node stored in (or removed from) a tier; the unit of :meth:`publish`.

    ``parent`` and ``num_tokens`` describe the chain (vLLM's parent hash / token count) and are
    only meaningful for stored chunks. ``tokens`` are the chunk's own token ids (int32-LE,
    ``num_tokens * 4`` bytes; None: not published), with what a consumer needs to name them
    as an engine's blocks: the namespace's ``chunk_tokens`` and ``lora_id``. They travel in
    the event stream only, never in the index's own entries (see :mod:`kvfabric.cluster.events`).
    """

    seed: bytes
    key: bytes
    tier: str
    parent: bytes = ROOT
    num_tokens: int = 0
    tokens: bytes | None = None
    chunk_tokens: int = 0
    lora_id: str = ""

    def __post_init__(self) -> None:
        check_key("namespace seed", self.seed)
        check_key("chunk key", self.key)
        check_key("parent key", self.parent)
        check_name("tier", self.tier)
        if not 0 <= self.num_tokens < 1 << 32:
            raise SpecError(f"num_tokens out of range: {self.num_tokens}")
        if self.tokens is not None and (
            len(self.tokens) != 4 * self.num_tokens
            or not 0 < self.num_tokens <= self.chunk_tokens < 1 << 32
        ):
            raise SpecError("tokens must be num_tokens int32 values of a chunk of chunk_tokens")
        if len(self.lora_id.encode()) > MAX_LORA_BYTES:
            raise SpecError(f"lora_id longer than {MAX_LORA_BYTES} bytes")


@dataclass(frozen=True)
class NodePrefix:
    """How many leading chunks of the requested chain one node holds, and in which tiers.

    ``tier_chunks`` counts, per tier, the leading chunks held there (a chunk held in two tiers
    counts in both), which is what a router's cost model and a puller's choice need.
    """

    node_id: str
    epoch: int
    chunks: int
    tier_chunks: dict[str, int] = field(hash=False)


class NodePrefixRow(TypedDict):
    """A :class:`NodePrefix` with the node's declared hardware class, as cluster-scope lookup
    answers list it (a msgpack / JSON map)."""

    node_id: str
    epoch: int
    chunks: int
    tier_chunks: dict[str, int]
    hardware_class: str


@dataclass(frozen=True)
class GlobalLookup:
    """Longest prefix of a chain held by live nodes (chunk *i* may come from any node).

    ``owners[i]`` are the live copies of chunk *i*; ``len(owners)`` is the matched length.
    ``stale`` is true when this client knows its view may lag (it lost the backend and has not
    republished since).
    """

    requested_chunks: int
    owners: tuple[tuple[Location, ...], ...]
    stale: bool = False

    @property
    def matched_chunks(self) -> int:
        return len(self.owners)

    def nodes(self) -> dict[str, NodePrefix]:
        """Per node: the leading chunks it holds on its own (a prefix from chunk 0)."""
        result: dict[str, NodePrefix] = {}
        alive: dict[str, tuple[int, dict[str, int]]] = {}
        for i, copies in enumerate(self.owners):
            here: dict[tuple[str, int], set[str]] = {}
            for loc in copies:
                here.setdefault((loc.node_id, loc.epoch), set()).add(loc.tier)
            if i == 0:
                alive = {node: (epoch, {}) for node, epoch in here}
            for node in list(alive):
                epoch, counts = alive[node]
                tiers = here.get((node, epoch))
                if tiers is None:
                    result[node] = NodePrefix(node, epoch, i, counts)
                    del alive[node]
                    continue
                for tier in tiers:
                    counts[tier] = counts.get(tier, 0) + 1
            if not alive:
                break
        for node, (epoch, counts) in alive.items():
            result[node] = NodePrefix(node, epoch, len(self.owners), counts)
        return result


@dataclass(frozen=True)
class KVEvent:
    """One entry of the KV event stream (fields after vLLM's BlockStored / BlockRemoved).

    ``keys`` is a run of chained chunks (``parent`` is the first one's parent) for ``stored``,
    any set of chunks for ``removed``; ``num_tokens`` is the run's total (0 for removed).
    ``token_ids`` (stored only, None when the node published none, and always in a
    :class:`IndexSnapshot`): each chunk's own token ids (int32-LE), in the order of ``keys``,
    of a namespace with chunks of ``chunk_tokens`` tokens and LoRA ``lora_id``.
    ``stream_id`` orders events; it is empty in a :class:`IndexSnapshot`.
    """

    kind: EventKind
    keys: tuple[bytes, ...]
    tier: str
    node_id: str
    epoch: int
    seed_hex: str
    parent: bytes = ROOT
    num_tokens: int = 0
    stream_id: str = ""
    token_ids: tuple[bytes, ...] | None = None
    chunk_tokens: int = 0
    lora_id: str = ""


@dataclass(frozen=True)
class LiveRegistration:
    """A node id's registration while its lease runs. ``lease_mark`` changes whenever the
    holder renews the lease (its deadline, on the backend's clock)."""

    address: str
    epoch: int
    lease_mark: float


DUPLICATE_POLL_S = 0.05


def refuse_duplicate(
    info: NodeInfo, current: Callable[[], LiveRegistration | None], takeover_after_s: float
) -> None:
    """Raise DuplicateNodeError if a live daemon already holds ``info.node_id``.

    ``current()`` reads the node id's live registration (None: none, or its lease lapsed).
    One under the same address is this node's previous incarnation: no error. One under
    another address is watched for ``takeover_after_s``: a renewal of its lease means a live
    daemon (refused); none means a dead one, which the caller then replaces. Whoever calls
    this with more than one heartbeat period of ``takeover_after_s`` never replaces a live
    node by accident.
    """
    first = current()
    if first is None or first.address == info.address:
        return
    give_up = time.monotonic() + takeover_after_s
    while time.monotonic() < give_up:
        time.sleep(min(DUPLICATE_POLL_S, max(0.0, give_up - time.monotonic())))
        now = current()
        if now is None:
            return  # its lease lapsed meanwhile
        if now != first:
            first = now
            break  # renewed (or re-registered): a live daemon
    else:
        if takeover_after_s > 0:
            return  # not renewed: a dead incarnation
    raise DuplicateNodeError(
        f"node id {info.node_id!r} is already registered by a live daemon at {first.address} "
        f"(epoch {first.epoch}); this daemon would be at {info.address}. Give each daemon its "
        f"own node_id (--node-id, or node_id in the config; two daemons on one host need "
        f"two ids, so not just the host name), or stop the other one first"
    )


@dataclass(frozen=True)
class IndexSnapshot:
    """Every live (chunk, node, tier) as ``stored`` events, consistent with ``stream_id``:
    apply ``events``, then every stream event after ``stream_id``."""

    stream_id: str
    events: tuple[KVEvent, ...]


class GlobalIndex(abc.ABC):
    """A node's (or router's) handle on the global index; see the module docstring."""

    @abc.abstractmethod
    def register(self, info: NodeInfo, *, takeover_after_s: float = 0.0) -> NodeInfo:
        """Register this node under a new epoch (returned in the NodeInfo) and start its lease.

        Raises DuplicateNodeError when another live node holds ``info.node_id`` under another
        address and renews its lease within ``takeover_after_s`` (0: refused while it is
        live); see :func:`refuse_duplicate`."""

    @abc.abstractmethod
    def heartbeat(self) -> None:
        """Renew this node's lease. Raises UnavailableError, or LeaseExpiredError if a newer
        epoch of the node replaced this one."""

    @abc.abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """Every node whose lease is live, with its current epoch."""

    @abc.abstractmethod
    def publish(
        self, stored: Sequence[ChunkRecord] = (), removed: Sequence[ChunkRecord] = ()
    ) -> None:
        """Queue updates of this node's inventory (stored first, then removed); never blocks."""

    @abc.abstractmethod
    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every update queued so far was sent; UnavailableError if it cannot be."""

    @abc.abstractmethod
    def republish(self, inventory: Iterable[ChunkRecord]) -> None:
        """Replace this node's published inventory: a new epoch, then ``inventory``."""

    @abc.abstractmethod
    def lookup(self, seed: bytes, keys: Sequence[bytes]) -> GlobalLookup:
        """Longest prefix of the chain ``keys`` (namespace ``seed``) held by live nodes."""

    @abc.abstractmethod
    def events(self, after_id: str = "0-0", block_ms: int = 0, count: int = 1000) -> list[KVEvent]:
        """Up to ``count`` events after ``after_id``, waiting up to ``block_ms`` for the first."""

    @abc.abstractmethod
    def snapshot(self) -> IndexSnapshot:
        """The live state of the whole index and the stream id it is consistent with."""

    @abc.abstractmethod
    def first_event_id(self) -> str:
        """The id of the oldest event the stream still holds ("0-0" when it holds none).

        A reader at position ``p`` (the last id it read) lost events when this is past ``p``
        after a read from ``p``: the stream is trimmed oldest first, so an event after ``p``
        trimmed before the read means ``p`` was trimmed too. (This also says "lost" when
        ``p`` alone went after the read: then the reader was a whole stream behind.)"""

    @property
    @abc.abstractmethod
    def stale(self) -> bool:
        """True while this client's published view may lag (backend lost, not republished)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the flusher (sending what is queued, best effort) and release connections."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chain_runs(records: Sequence[ChunkRecord]) -> list[list[ChunkRecord]]:
    """Split stored records into runs of one chain (same namespace and tier, each chunk the
    parent of the next, all with token ids or none): one event per run keeps the stream
    compact, like vLLM's BlockStored."""
    runs: list[list[ChunkRecord]] = []
    for rec in records:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last.seed == rec.seed
            and last.tier == rec.tier
            and rec.parent == last.key
            and (last.tokens is None) == (rec.tokens is None)
            and (last.chunk_tokens, last.lora_id) == (rec.chunk_tokens, rec.lora_id)
        ):
            runs[-1].append(rec)
        else:
            runs.append([rec])
    return runs


def removal_groups(records: Sequence[ChunkRecord]) -> list[list[ChunkRecord]]:
    """Group removed records by (namespace, tier), keeping first-seen order."""
    groups: dict[tuple[bytes, str], list[ChunkRecord]] = {}
    for rec in records:
        groups.setdefault((rec.seed, rec.tier), []).append(rec)
    return list(groups.values())


def parse_stream_id(stream_id: str) -> tuple[int, int]:
    """'<ms>-<seq>' as a comparable pair; SpecError when malformed."""
    ms, sep, seq = stream_id.partition("-")
    try:
        return int(ms), int(seq) if sep else 0
    except ValueError:
        raise SpecError(f"bad stream id {stream_id!r}") from None


Update = tuple[EventKind, ChunkRecord]


class BatchingIndex(GlobalIndex):
    """Shared write path: :meth:`publish` queues, a daemon thread sends batches.

    A backend implements :meth:`_send` (one batch, in order, one round trip where it can) and
    may override :meth:`_tick` (called by the flusher at least every ``flush_interval``). A batch
    whose send fails is dropped, not retried: the backend is then stale and the node's
    :meth:`republish` of its whole inventory supersedes it. The queue is bounded by
    ``max_pending``; beyond it the oldest updates are dropped for the same reason.
    """

    def __init__(
        self, *, flush_interval: float = 0.005, max_batch: int = 4096, max_pending: int = 1 << 20
    ) -> None:
        if flush_interval <= 0 or max_batch <= 0 or max_pending <= 0:
            raise SpecError("flush_interval, max_batch and max_pending must be positive")
        self._interval = flush_interval
        self._max_batch = max_batch
        self._pending: deque[Update] = deque(maxlen=max_pending)
        self._cond = threading.Condition()
        self._queued = 0  # updates ever queued
        self._done = 0  # updates ever sent or dropped
        self._failures = 0
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"{type(self).__name__}-flusher", daemon=True
        )
        self._thread.start()

    @abc.abstractmethod
    def _send(self, batch: list[Update]) -> None:
        """Apply one batch; raise UnavailableError when the backend cannot be reached."""

    def _tick(self) -> None:
        """Periodic work of the flusher thread (lease-loss recovery); default none."""

    def publish(
        self, stored: Sequence[ChunkRecord] = (), removed: Sequence[ChunkRecord] = ()
    ) -> None:
        updates: list[Update] = [("stored", r) for r in stored]
        updates += [("removed", r) for r in removed]
        for _, rec in updates:
            if not isinstance(rec, ChunkRecord):
                raise SpecError(f"publish takes ChunkRecord values, got {type(rec).__name__}")
        with self._cond:
            if self._closed:
                raise UnavailableError("the global index is closed")
            overflow = len(self._pending) + len(updates) - (self._pending.maxlen or 0)
            if overflow > 0:  # the deque drops the oldest; count them as done-and-failed
                self._done += min(overflow, len(self._pending))
                self._failures += 1
            self._pending.extend(updates)
            self._queued += len(updates)
            if len(self._pending) >= self._max_batch:
                self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            target, failures = self._queued, self._failures
            if self._done < target:  # wake the flusher only when there is work
                self._cond.notify_all()
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise DeadlineExceededError(f"global index flush not done in {timeout}s")
                self._cond.wait(left)
            if self._failures != failures:
                raise UnavailableError("global index updates were dropped: backend unavailable")
        if self.stale:
            raise UnavailableError("global index is stale: waiting to republish the inventory")

    def _discard_pending(self) -> None:
        """Drop queued updates (a republish of the full inventory supersedes them)."""
        with self._cond:
            self._done += len(self._pending)
            self._pending.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(self._interval)
                if self._closed and not self._pending:
                    return
                batch = [
                    self._pending.popleft() for _ in range(min(self._max_batch, len(self._pending)))
                ]
            failed = False
            if batch:
                try:
                    self._send(batch)
                except UnavailableError:
                    failed = True
            with self._cond:
                self._done += len(batch)
                self._failures += failed
                self._cond.notify_all()
            if not batch or failed:
                # a failed send may mean the index must be rebuilt (a stale Redis index
                # refuses updates until it republishes): with puts arriving faster than the
                # back-off, a tick only on an empty queue would never come
                try:
                    self._tick()
                except KVFabricError:
                    pass  # _tick records staleness itself; the next tick tries again
            if failed:
                with self._cond:  # back off instead of spinning on a dead backend
                    if not self._closed:
                        self._cond.wait(self._interval * 10)

    def _stop_flusher(self, timeout: float = 2.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
