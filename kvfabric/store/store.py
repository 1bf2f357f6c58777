"""The node-local tiered KV store.

Public operations (all thread-safe; every one takes the namespace, which the store enforces:
a key of another namespace is a miss, never a hit):

* :meth:`TieredStore.reserve` / :meth:`~TieredStore.put` — pages are allocated in the first
  memory tier with room (demoting colder objects down the tier order to make it); the
  producer writes layers into them and commits layer by layer (:class:`ObjectWriter`).
* :meth:`~TieredStore.get` / :meth:`~TieredStore.pin` — a pinned, zero-copy
  :class:`ObjectReader`; an object on SSD is first read back into memory (checksum verified),
  and an object in a lower memory tier is promoted on hit.
* :meth:`~TieredStore.lookup` — longest stored prefix of a chain of keys, per tier.
* :meth:`~TieredStore.contains`, :meth:`~TieredStore.delete`, :meth:`~TieredStore.stats`.

Placement: tiers are ordered fastest first (``device``/``dram``, ``cxl``, ``ssd``). When a
tier passes its high watermark, a maintenance thread demotes victims to the next tier until
the low watermark; a put that finds no room demotes synchronously. The last tier evicts.
Victims are chosen by :class:`~kvfabric.store.index.LocalIndex`: leaves of a chain first,
LRU among leaves; pinned, moving or incomplete objects never. Every eviction is counted.

Tenants: a configured tenant's objects live in arenas of its own, within its quotas
(:mod:`kvfabric.store.tenants`); :meth:`TieredStore.arenas` says which arenas a tenant's
clients may map. A namespace is forgotten once it holds nothing (no table slot, no counters).

Leases: each committed layer renews a reservation for ``reservation_timeout_s`` (a writer
streaming the layers of a forward pass that takes longer than that keeps its lease as long
as it makes progress). A reservation whose deadline passes is aborted, but its pages stay
**quarantined** (taken, used by nothing) until the writer gives the lease back
(:meth:`ObjectWriter.close`; the daemon does it when the writer's session ends): a writer
frozen past its deadline may still be copying into them, and they must not belong to another
object when it resumes. An expired pin is simply dropped: a late reader only reads (and is told
its read may be torn).

Durability: an SSD demotion is acknowledged (the object leaves memory) only once its record
is written; SSD contents survive a restart and are re-indexed from the segment headers, and
an object read back from SSD keeps its record there until the SSD needs the space (so a
crash after a read loses nothing). Memory tiers are volatile. A disk fault degrades the SSD
tier (``degraded_tiers``): puts go on, memory evicts instead of demoting, the SSD is still
read, and :meth:`TieredStore.maintain` probes until it takes writes again.

Locking: one re-entrant lock guards the index, the tiers' allocators and the counters. Bulk
copies between memory tiers run under it (they are memcpy-fast); SSD reads and writes run
outside it, with the object marked MOVING. How objects move is :mod:`kvfabric.store.placement`;
this module is the API, the leases, lookups, statistics and the lifecycle.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvfabric.errors import (
    AlreadyExistsError,
    ConfigError,
    DeadlineExceededError,
    KVFabricError,
    LeaseExpiredError,
    NotFoundError,
    ObjectAbortedError,
    SpecError,
    SpecMismatchError,
    WouldBlockError,
)
from kvfabric.hashing import KEY_BYTES, ROOT, chunk_keys
from kvfabric.lookup import LookupResult
from kvfabric.memory.arena import SharedArena
from kvfabric.memory.copy import Piece
from kvfabric.payload import put_whole
from kvfabric.spec import Namespace
from kvfabric.store.codec import FP8
from kvfabric.store.config import StoreConfig
from kvfabric.store.factory import AnyTier, build_tier
from kvfabric.store.handles import ObjectReader, ObjectWriter, _Lease
from kvfabric.store.index import ABORTED, FP8_ON_DISK, MOVING, READY_ALL, REMOVED, Entry, LocalIndex
from kvfabric.store.placement import Placement, decode_meta
from kvfabric.store.protocol import InventoryListener, RemovedObject, StoredObject, TokenIds
from kvfabric.store.shards import HeadRange, HeadShards, head_mask
from kvfabric.store.ssd_usage import SsdUsage
from kvfabric.store.stats import (
    NamespaceCounters,
    NamespaceStats,
    StoreStats,
    TierCounters,
    TierStats,
)
from kvfabric.store.tenants import EVERY_TENANT, ArenaInfo, EveryTenant, Tenancy
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.host import HostTier

log = logging.getLogger(__name__)

MAX_NAMESPACES = 1 << 16


class TieredStore:
    """Objects (chunks) in memory / SSD tiers with a prefix-aware local index."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        maintenance: bool = True,
        tenants: Iterable[str] = (),
    ) -> None:
        """``tenants``: tenant salts whose objects get arenas of their own (the daemon's
        token tenants); tenants named in ``config.quotas`` get them too."""
        self.config = config or StoreConfig()
        data_dir = Path(self.config.data_dir)
        try:
            data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"data_dir {str(data_dir)!r} cannot be created: {exc}") from None
        self._names = [t.name for t in self.config.tiers]
        self._tiers: list[AnyTier] = []
        try:
            for tier_config in self.config.tiers:
                self._tiers.append(build_tier(tier_config, data_dir.resolve()))
        except BaseException:
            for tier in self._tiers:
                tier.close()
            raise
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._index = LocalIndex(len(self._tiers), self._namespace_empty)
        try:
            self._tenancy = Tenancy(self.config, self._tiers, self._names, self._index, tenants)
        except BaseException:
            for tier in self._tiers:
                tier.close()
            raise
        self._tier_counters = [TierCounters() for _ in self._tiers]
        self._placement = Placement(
            self._tiers,
            self._names,
            self._index,
            self._tier_counters,
            self._cond,
            self.config,
            lambda: self._reclaim_expired(time.monotonic()),
            self._inventory_changed,
            SsdUsage(self._tenancy.ssd_limits),
        )
        self._disk_index = self._placement.disk_index
        self._ns_counters: dict[tuple[str, str], NamespaceCounters] = {}
        self._namespaces: dict[bytes, Namespace] = {}
        self._ns_pairs: dict[tuple[str, str], int] = {}  # (model, tenant) -> namespaces held
        self._leases: dict[int, _Lease] = {}
        # expired reservations whose writers have not given them back: pages held for them
        self._quarantine: dict[int, ObjectWriter] = {}
        self._layer_listeners: list[Callable[[], None]] = []
        self._inventory_listeners: list[InventoryListener] = []
        self._count = dict.fromkeys(
            (
                "lookups",
                "lookup_tokens",
                "hit_tokens",
                "miss_tokens",
                "peer_hit_tokens",
                "puts",
                "gets",
                "deletes",
                "expired",
                "aborted",
            ),
            0,
        )
        self._closed = False
        if self._disk_index is not None:
            self._recover()
        self._stop = threading.Event()
        self._maintainer: threading.Thread | None = None
        if maintenance:
            self._maintainer = threading.Thread(
                target=self._maintain_loop, daemon=True, name="kvfabric-store-maintenance"
            )
            self._maintainer.start()

    # ------------------------------------------------------------------ writing

    def reserve(
        self,
        ns: Namespace,
        key: bytes,
        *,
        parent: bytes = ROOT,
        num_tokens: int | None = None,
        heads: HeadRange | None = None,
    ) -> ObjectWriter:
        """Allocate an object and return its writer (commit layers, or abort).

        With ``heads`` the writer writes only that KV-head range (one tensor-parallel rank):
        the other ranks reserve the same key with their own ranges and join the object
        (see :mod:`kvfabric.store.shards`)."""
        _check_key("key", key)
        _check_key("parent", parent)
        num_tokens = ns.spec.chunk_tokens if num_tokens is None else num_tokens
        nbytes = ns.spec.layout(num_tokens).nbytes  # validates num_tokens
        if heads is not None:
            head_mask(heads, ns.spec.num_kv_heads)  # validates the range
        with self._lock:
            self._check_open()
            known = self._namespaces.get(ns.seed)
            existing = None if known is None else self._index.find(known, key)
            if existing is not None:
                return self._join(existing, parent, num_tokens, heads)
            if known is None:  # fail before allocating: a namespace over the tenant's limit
                self._tenancy.add_namespace(ns, check_only=True)
            self._tenancy.begin_write(ns.tenant_salt, check_only=True)
            tier, pages = self._placement.allocate(nbytes, ns.tenant_salt)
            try:  # allocating may have waited: the namespace may be gone, the key taken
                ns = self._intern(ns)
                if self._index.find(ns, key) is not None:
                    raise AlreadyExistsError(f"{key.hex()} was stored meanwhile")
                self._tenancy.begin_write(ns.tenant_salt, check_only=True)
            except BaseException:
                self._tiers[tier].free(pages)  # type: ignore[union-attr]
                raise
            entry = Entry(key, parent, ns, num_tokens, tier, pages)
            if heads is not None:
                entry.shards = HeadShards(ns.spec.num_kv_heads, ns.spec.num_layers)
            self._index.add(entry)
            return self._new_writer(entry, heads)

    def _join(
        self, entry: Entry, parent: bytes, num_tokens: int, heads: HeadRange | None
    ) -> ObjectWriter:
        """Another tensor-parallel rank's writer for an object being written by ranges."""
        if (
            heads is None
            or entry.shards is None
            or entry.complete
            or entry.flags & (ABORTED | REMOVED)
        ):
            raise AlreadyExistsError(f"{entry.key.hex()} is already stored or being written")
        if entry.parent != parent or entry.num_tokens != num_tokens:
            raise SpecMismatchError(
                f"{entry.key.hex()} is being written with parent "
                f"{entry.parent.hex()} and {entry.num_tokens} tokens"
            )
        return self._new_writer(entry, heads)

    def _new_writer(self, entry: Entry, heads: HeadRange | None) -> ObjectWriter:
        mask = entry.shards.claim(heads) if heads is not None else 0
        self._tenancy.begin_write(entry.ns.tenant_salt)
        entry.pins += 1  # the writer's reservation
        writer = ObjectWriter(
            self,
            entry,
            time.monotonic() + self.config.reservation_timeout_s,
            heads=heads,
            head_mask=mask,
        )
        self._leases[id(writer)] = writer
        return writer

    def put(
        self,
        ns: Namespace,
        key: bytes,
        data: Any,
        *,
        parent: bytes = ROOT,
        num_tokens: int | None = None,
    ) -> bool:
        """Store a whole payload in canonical layout; ``False`` if the key is already stored."""
        return put_whole(lambda: self.reserve(ns, key, parent=parent, num_tokens=num_tokens), data)

    def _commit_layers(self, writer: ObjectWriter, mask: int) -> bool:
        with self._lock:
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
                self._end_lease(writer)
            else:  # progress renews the lease: a long forward pass keeps its reservation
                writer.deadline = max(
                    writer.deadline, time.monotonic() + self.config.reservation_timeout_s
                )
            if ready == full:
                entry.ready = READY_ALL
                entry.shards = None
                self._count["puts"] += 1
                self._tier_counters[entry.tier].bytes_in += entry.ns.spec.layout(
                    entry.num_tokens
                ).nbytes
                self._inventory_changed([entry], [])
            else:
                entry.ready = ready
            self._layers_changed()
            return done

    def _abort(self, writer: ObjectWriter) -> None:
        with self._lock:
            if writer.closed or writer.expired:
                return
            self._abort_entry(writer._entry)
            self._end_lease(writer)

    def _abort_entry(self, entry: Entry) -> None:
        if not entry.flags & ABORTED:  # a delete, then the writer's own abort: one write
            entry.flags |= ABORTED
            self._count["aborted"] += 1
        self._placement.drop(entry)
        self._layers_changed()

    # ------------------------------------------------------------------ reading

    def get(
        self,
        ns: Namespace,
        key: bytes,
        *,
        timeout: float | None = None,
        lease_s: float | None = None,
    ) -> ObjectReader:
        """Pin an object (possibly still being written) and return its reader."""
        _check_key("key", key)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._check_open()
                entry = self._find(ns, key)
                if entry.flags & MOVING and entry.tier == self._disk_index:
                    self._placement.wait(deadline, f"{key.hex()} is being read back from SSD")
                    continue
                if entry.tier != self._disk_index:
                    if (
                        self.config.promote_on_hit
                        and entry.tier != self._placement.paged[0]
                        and entry.complete
                        and entry.pins == 0
                        and not entry.flags & MOVING
                    ):
                        self._placement.promote_in_memory(entry)
                    return self._pin(entry, lease_s)
                if getattr(self._placement.nonblocking, "on", False):
                    raise WouldBlockError(f"{key.hex()} must be read back from SSD")
                extent, target = entry.handle, self._placement.start_disk_promotion(entry)
            self._placement.finish_disk_promotion(entry, extent, target)

    @contextlib.contextmanager
    def nonblocking(self) -> Iterator[None]:
        """Within this block (this thread only) an operation that would wait — for room, an
        SSD read, a layer — raises WouldBlockError instead, before changing anything it
        cannot finish; the daemon then repeats it on a worker thread."""
        flag = self._placement.nonblocking
        flag.on = True
        try:
            yield
        finally:
            flag.on = False

    @property
    def in_nonblocking_mode(self) -> bool:
        """Whether this thread is inside :meth:`nonblocking` (callers that would do slow
        I/O of their own raise WouldBlockError then, as the store does)."""
        return bool(getattr(self._placement.nonblocking, "on", False))

    def pin(self, ns: Namespace, key: bytes, lease_s: float) -> ObjectReader:
        """:meth:`get` with an explicit pin deadline (seconds)."""
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        return self.get(ns, key, lease_s=lease_s)

    def unpin(self, reader: ObjectReader) -> None:
        reader.release()

    def _pin(self, entry: Entry, lease_s: float | None) -> ObjectReader:
        entry.pins += 1
        self._index.touch(entry)
        self._count["gets"] += 1
        lease = self.config.pin_timeout_s if lease_s is None else lease_s
        reader = ObjectReader(self, entry, time.monotonic() + lease)
        self._leases[id(reader)] = reader
        self._tier_counters[entry.tier].bytes_out += reader.nbytes
        return reader

    def _unpin(self, reader: ObjectReader) -> None:
        with self._lock:
            if not reader.closed and not reader.expired:
                self._end_lease(reader)

    def _end_lease(self, lease: _Lease) -> None:
        lease.closed = True
        self._leases.pop(id(lease), None)
        entry = lease._entry
        entry.pins -= 1
        if isinstance(lease, ObjectWriter):
            self._tenancy.end_write(entry.ns.tenant_salt)
        self._placement.free_if_dead(entry)

    def _end_quarantine(self, writer: ObjectWriter) -> None:
        """The writer of an expired reservation gave it back: its pages may be reused."""
        with self._lock:
            if self._quarantine.pop(id(writer), None) is not None:
                self._end_lease(writer)

    def add_layer_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (under the store lock: it must be quick and must not call the
        store) whenever a layer is committed or a write aborted, so an event loop can wait
        for layers without parking a thread per waiter."""
        self._layer_listeners.append(callback)

    def add_inventory_listener(self, callback: InventoryListener, *, replay: bool = False) -> None:
        """Call ``callback(stored, removed)`` whenever complete objects change: an object
        becomes complete or moves to another tier (``stored``, with its new tier; a move also
        lists the old tier in ``removed``), or is removed — deleted, evicted, aborted, dropped
        as corrupt (``removed``). Objects recovered from SSD at start are not reported: see
        :meth:`inventory`. With ``replay``, the current inventory is first reported as stored,
        atomically with the registration, so no change is missed or reordered.

        The callback runs under the store lock, on whichever thread made the change: it must
        be quick (enqueue and return), must not call the store, and should not raise (an
        exception is logged and ignored so that the store's own work completes)."""
        with self._lock:
            self._inventory_listeners.append(callback)
            if replay:
                self._call_inventory_listener(callback, list(self.inventory()), [])

    def inventory(self) -> Iterator[StoredObject]:
        """Every complete object as (namespace, key, parent, num_tokens, tier name); a
        snapshot taken under the lock (for a republish of the whole inventory)."""
        with self._lock:
            return iter(
                [
                    (e.ns, e.key, e.parent, e.num_tokens, self._names[e.tier])
                    for e in self._index.entries()
                    if e.complete
                ]
            )

    def _inventory_changed(self, stored: list[Entry], removed: list[tuple[Entry, int]]) -> None:
        if not self._inventory_listeners:
            return
        stored_out = [(e.ns, e.key, e.parent, e.num_tokens, self._names[e.tier]) for e in stored]
        removed_out = [(e.ns, e.key, self._names[tier]) for e, tier in removed]
        for callback in self._inventory_listeners:
            self._call_inventory_listener(callback, stored_out, removed_out)

    def _call_inventory_listener(
        self, callback: InventoryListener, stored: list[StoredObject], removed: list[RemovedObject]
    ) -> None:
        try:
            callback(stored, removed)
        except Exception:  # a listener bug must not leave a store operation half done
            log.exception("inventory listener failed")

    def _layers_changed(self) -> None:
        self._cond.notify_all()
        for callback in self._layer_listeners:
            callback()

    def _layer_ready(self, entry: Entry, layer: int) -> bool:
        return entry.ready == READY_ALL or bool(entry.ready >> layer & 1)

    def _wait_layer(self, entry: Entry, layer: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._layer_ready(entry, layer):
                if entry.flags & ABORTED:
                    raise ObjectAbortedError(f"the writer of {entry.key.hex()} aborted")
                self._placement.wait(deadline, f"layer {layer} of {entry.key.hex()} not committed")

    def _pieces(self, entry: Entry, offset: int, length: int) -> list[Piece]:
        return self._placement.pieces(entry, offset, length)

    # ------------------------------------------------------------------ queries

    def lookup(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        *,
        num_tokens: int | None = None,
        peer_chunks: int = 0,
    ) -> LookupResult:
        """Longest prefix of the chain ``keys`` stored in ``ns`` (in-flight writes count,
        except objects tensor-parallel ranks write by head range: those count once every
        range landed, since a rank that never reserves its range leaves no lease to expire).

        ``num_tokens``: the tokens the chain covers, when its last chunk may be partial (a
        missed partial chunk then counts its real tokens, not ``chunk_tokens``); None: every
        unmatched chunk is full. ``peer_chunks``: the longest prefix of the chain another
        node holds (a cluster-scope lookup); the tokens it covers past the local prefix
        count as hits from ``peer`` (:attr:`LookupResult.peer_tokens`), not as misses.

        A namespace the store has never held is a plain miss: lookups never create state,
        so callers cannot grow the store's tables by asking about made-up namespaces.
        """
        with self._lock:
            known = self._namespaces.get(ns.seed)
            if known is None:
                chunks, per_tier = [0] * len(self._tiers), [0] * len(self._tiers)
            else:
                chunks, per_tier = self._index.prefix_counts(known, keys)
            matched, matched_chunks = sum(per_tier), sum(chunks)
            requested = matched + (len(keys) - matched_chunks) * ns.spec.chunk_tokens
            if num_tokens is not None:  # the partial last chunk's real size
                requested = max(matched, min(requested, num_tokens))
            peer = 0
            if peer_chunks > matched_chunks:
                peer = max(0, min(peer_chunks * ns.spec.chunk_tokens, requested) - matched)
            self._count_lookup(known, requested, matched, per_tier, chunks, peer)
        return LookupResult(
            len(keys),
            matched_chunks,
            matched,
            {self._names[i]: n for i, n in enumerate(per_tier) if n},
            requested_tokens=requested,
            peer_tokens=peer,
        )

    def lookup_tokens(
        self, ns: Namespace, tokens: TokenIds, *, peer_chunks: int = 0
    ) -> LookupResult:
        """:meth:`lookup` of a prompt's full chunks, hashed here."""
        return self.lookup(
            ns, chunk_keys(ns, tokens, include_partial=False), peer_chunks=peer_chunks
        )

    def _count_lookup(
        self,
        ns: Namespace | None,
        requested: int,
        matched: int,
        per_tier: list[int],
        chunks: list[int],
        peer: int = 0,
    ) -> None:
        count = self._count
        count["lookups"] += 1
        count["lookup_tokens"] += requested
        count["hit_tokens"] += matched + peer
        count["peer_hit_tokens"] += peer
        count["miss_tokens"] += requested - matched - peer
        for i, tokens in enumerate(per_tier):
            if tokens:
                self._tier_counters[i].hit_tokens += tokens
                self._tier_counters[i].hit_chunks += chunks[i]
        if ns is None:
            return  # per-namespace counters exist only for namespaces the store holds
        nsc = self._ns_counters.setdefault((ns.model_id, ns.tenant_salt), NamespaceCounters())
        nsc.lookups += 1
        nsc.lookup_tokens += requested
        nsc.hit_tokens += matched + peer

    def contains(self, ns: Namespace, key: bytes) -> bool:
        with self._lock:
            return self._lookup_entry(ns, key) is not None

    def tier_of(self, ns: Namespace, key: bytes) -> str:
        with self._lock:
            return self._names[self._find(ns, key).tier]

    def delete(self, ns: Namespace, key: bytes) -> bool:
        """Remove an object (a writer in progress is aborted); ``False`` if absent."""
        with self._lock:
            entry = self._lookup_entry(ns, key)
            if entry is None:
                return False
            self._count["deletes"] += 1
            if entry.complete:
                self._placement.drop(entry)
            else:
                self._abort_entry(entry)
            return True

    def evict(self, tier: str | None = None, nbytes: int | None = None) -> int:
        """Admin: drop unpinned objects (of one tier, or from the last tier up) until
        ``nbytes`` are freed, or all of them. Returns how many were evicted (and counted)."""
        if tier is not None and tier not in self._names:
            raise NotFoundError(f"no tier named {tier!r}; tiers: {self._names}")
        order = (
            [self._names.index(tier)]
            if tier is not None
            else list(range(len(self._tiers) - 1, -1, -1))
        )
        evicted = freed = 0
        with self._lock:
            progress = True
            while progress and (nbytes is None or freed < nbytes):
                # a pass may turn parents into leaves (in this or an upper tier): go again
                progress = False
                for tier_index in order:
                    while nbytes is None or freed < nbytes:
                        victim = self._index.pick_victim_for_eviction(tier_index)
                        if victim is None:
                            break
                        freed += victim.ns.spec.layout(victim.num_tokens).nbytes
                        self._placement.evict(victim)
                        evicted += 1
                        progress = True
        return evicted

    def host_arenas(self) -> list[tuple[int, str, SharedArena]]:
        """(arena id, tier name, arena) of every shared-memory arena (the default arena of
        tier ``i`` has id ``i``): what a peer transport registers."""
        return [(a.arena_id, a.tier_name, a.arena) for a in self._tenancy.arenas()]

    def arenas(self, tenant: str | EveryTenant | None = EVERY_TENANT) -> list[ArenaInfo]:
        """The arenas a local session of ``tenant`` may map (None: the admin's default
        arenas only; no argument: every arena)."""
        return self._tenancy.arenas(tenant)

    def arena_id(self, entry: Entry) -> int | None:
        """The arena an entry's pages lie in (None: not in a host arena)."""
        return self._tenancy.arena_id(entry.tier, entry.handle)

    @property
    def degraded_tiers(self) -> list[str]:
        """Names of the tiers a write fault degraded (no lock: safe on an event loop)."""
        disk = self._placement.disk()
        return [self._names[-1]] if disk is not None and disk.degraded else []

    def tier_name(self, index: int) -> str:
        return self._names[index]

    @property
    def tier_names(self) -> list[str]:
        return list(self._names)

    def __len__(self) -> int:
        return len(self._index)

    # ------------------------------------------------------------------ placement

    # ------------------------------------------------------------------ maintenance

    def _reclaim_expired(self, now: float) -> int:
        expired = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in expired:
            entry = lease._entry
            if isinstance(lease, ObjectWriter):
                if not entry.complete:
                    self._abort_entry(entry)
                # quarantined: its pin keeps the pages until the writer gives the lease back
                self._leases.pop(id(lease), None)
                self._quarantine[id(lease)] = lease
                log.warning(
                    "reservation of %s expired; aborted, its pages quarantined until "
                    "the writer lets go",
                    entry.key.hex(),
                )
            else:
                log.warning("pin on %s expired; reclaimed", entry.key.hex())
                self._end_lease(lease)
            lease.expired = True
        self._count["expired"] += len(expired)
        if expired:
            self._cond.notify_all()
        return len(expired)

    def maintain(self) -> None:
        """One maintenance pass: expire leases, demote above watermarks, compact the SSD
        (and, while it is degraded by a write fault, probe whether it takes writes again)."""
        disk = self._placement.disk()
        if disk is not None and disk.degraded:
            disk.probe()  # rate-limited by the tier; never under the store lock
        with self._lock:
            if self._closed:
                return
            self._reclaim_expired(time.monotonic())
            self._release_memory()
            for tier_index in self._placement.paged:
                self._placement.drain_to_low_watermark(tier_index)
            disk = self._placement.disk()
            if (
                disk is not None
                and disk.used_bytes > self.config.high_watermark * disk.capacity_bytes
            ):
                live = disk.stats().live_bytes
                self._placement.evict_disk_leaves(
                    int(live - self.config.low_watermark * disk.capacity_bytes)
                )
        if disk is not None:
            disk.compact(
                self._placement.relocate,
                min_dead_ratio=self.config.compact_dead_ratio,
                forget=self._placement.forget,
            )

    def _maintain_loop(self) -> None:
        while not self._stop.wait(self.config.maintenance_interval_s):
            try:
                self.maintain()
            except Exception:  # the loop must outlive any one bad pass
                log.exception("store maintenance pass failed")

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every SSD write queued so far has completed and been indexed."""
        self._placement.flush(timeout)

    def _recover(self) -> None:
        disk, disk_index = self._placement.disk(), self._disk_index
        assert disk is not None and disk_index is not None
        for record in disk.scan():
            try:
                ns, parent, num_tokens, fmt = decode_meta(record.meta)
            except (KVFabricError, ValueError, TypeError, KeyError) as exc:
                log.warning(
                    "SSD record %s has unreadable metadata (%s); dropped", record.key.hex(), exc
                )
                disk.delete(record.extent)
                continue
            entry = Entry(
                record.key,
                parent,
                self._intern(ns, recovering=True),
                num_tokens,
                disk_index,
                record.extent,
            )
            entry.ready = READY_ALL
            if fmt == FP8:
                entry.flags |= FP8_ON_DISK
            self._index.add(entry)
            # the record's metadata names its tenant: its SSD bytes survive the restart
            self._placement.ssd.add(ns.tenant_salt, record.extent.span)

    # ------------------------------------------------------------------ helpers

    def _release_memory(self) -> None:
        """Give free memory back to the OS, and shrink the index's tables after a mass
        eviction (neither does it by itself)."""
        for tier in self._tiers:
            if isinstance(tier, HostTier):
                tier.release_free_memory(int(self.config.free_memory_kept * tier.capacity_bytes))
        self._index.compact()

    def _intern(self, ns: Namespace, *, recovering: bool = False) -> Namespace:
        known = self._namespaces.get(ns.seed)
        if known is not None:
            return known
        if len(self._namespaces) >= MAX_NAMESPACES:
            raise SpecError(f"too many namespaces (limit {MAX_NAMESPACES})")
        self._tenancy.add_namespace(ns, force=recovering)
        self._namespaces[ns.seed] = ns
        pair = (ns.model_id, ns.tenant_salt)
        self._ns_pairs[pair] = self._ns_pairs.get(pair, 0) + 1
        return ns

    def _namespace_empty(self, ns: Namespace) -> None:
        """The index's last entry of ``ns`` left: forget the namespace (lock held)."""
        if self._namespaces.get(ns.seed) is not ns:
            return
        del self._namespaces[ns.seed]
        self._tenancy.drop_namespace(ns)
        pair = (ns.model_id, ns.tenant_salt)
        left = self._ns_pairs[pair] - 1
        if left:
            self._ns_pairs[pair] = left
        else:  # no namespace of this (model, tenant) holds data: no counters, no label slot
            del self._ns_pairs[pair]
            self._ns_counters.pop(pair, None)

    def holds_namespace(self, ns: Namespace) -> bool:
        """Whether ``ns`` holds any object (no lock: one dict read)."""
        return ns.seed in self._namespaces

    def _lookup_entry(self, ns: Namespace, key: bytes) -> Entry | None:
        """The entry of ``key`` in ``ns``; never creates namespace state."""
        known = self._namespaces.get(ns.seed)
        return None if known is None else self._index.find(known, key)

    def _find(self, ns: Namespace, key: bytes) -> Entry:
        entry = self._lookup_entry(ns, key)
        if entry is not None:
            return entry
        for other in self._index.any_with_key(key):
            if (other.ns.model_id, other.ns.tenant_salt, other.ns.lora_id) == (
                ns.model_id,
                ns.tenant_salt,
                ns.lora_id,
            ):
                raise SpecMismatchError(
                    f"{key.hex()} is stored with spec {other.ns.spec}, requested {ns.spec}"
                )
        raise NotFoundError(f"no object {key.hex()} in this namespace")

    def _check_open(self) -> None:
        if self._closed:
            raise KVFabricError("store is closed")

    # ------------------------------------------------------------------ stats / lifecycle

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = []
            for i, tier in enumerate(self._tiers):
                c = self._tier_counters[i]
                extra: dict[str, Any] = {}
                if isinstance(tier, DiskTier):
                    disk_stats = tier.stats()
                    extra = {
                        "corrupt_records": disk_stats.corrupt_records,
                        "torn_records": disk_stats.torn_records,
                        "degraded": disk_stats.degraded,
                        "disk_errors": disk_stats.disk_errors,
                        "refused_demotions": c.refused_demotions,
                        "quota_refused_demotions": c.quota_refused_demotions,
                        "tenant_bytes": self._placement.ssd.by_tenant(),
                    }
                elif isinstance(tier, HostTier):
                    extra = {
                        "tenant_bytes": {t: tier.pool_used_bytes(t) for t in self._tenancy.tenants}
                    }
                tiers.append(
                    TierStats(
                        name=self._names[i],
                        kind=self.config.tiers[i].kind.value,
                        capacity_bytes=tier.capacity_bytes,
                        used_bytes=tier.used_bytes,
                        objects=self._index.tier_count(i),
                        hit_tokens=c.hit_tokens,
                        hit_chunks=c.hit_chunks,
                        evictions=c.evictions,
                        promotions=c.promotions,
                        demotions=c.demotions,
                        bytes_in=c.bytes_in,
                        bytes_out=c.bytes_out,
                        bytes_saved=c.bytes_saved,
                        **extra,
                    )
                )
            count = self._count
            return StoreStats(
                tiers=tuple(tiers),
                objects=len(self._index),
                lookups=count["lookups"],
                lookup_tokens=count["lookup_tokens"],
                hit_tokens=count["hit_tokens"],
                miss_tokens=count["miss_tokens"],
                peer_hit_tokens=count["peer_hit_tokens"],
                puts=count["puts"],
                gets=count["gets"],
                deletes=count["deletes"],
                expired_leases=count["expired"],
                aborted_writes=count["aborted"],
                namespaces=tuple(
                    NamespaceStats(m, t, c.lookups, c.lookup_tokens, c.hit_tokens)
                    for (m, t), c in sorted(self._ns_counters.items())
                ),
            )

    def close(self) -> None:
        """Stop maintenance, write memory-resident objects to SSD (``persist_on_close``),
        finish queued SSD writes, release all memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._maintainer is not None:
            self._maintainer.join()
        disk = self._placement.disk()
        if disk is not None:
            try:
                if self.config.persist_on_close:
                    with self._lock:
                        moved = self._placement.spill()
                    log.info("wrote %d memory-resident objects to SSD before closing", moved)
                self.flush()
            except DeadlineExceededError:
                log.warning("closing with SSD demotions still in flight")
            disk.close()  # joins the writers: never under the lock their callbacks take
        with self._lock:
            self._tenancy.close()
            for tier in self._tiers:
                if tier is not disk:
                    tier.close()
            self._cond.notify_all()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_key(name: str, key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise SpecError(f"{name} must be {KEY_BYTES} bytes")
