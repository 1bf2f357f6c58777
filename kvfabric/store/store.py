"""The node-local tiered KV store: its API and lifecycle.

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
clients may map. A namespace is forgotten once it holds nothing
(:mod:`kvfabric.store.namespaces`).

Leases (:mod:`kvfabric.store.leases`): each committed layer renews a reservation; an expired
reservation is aborted and its pages quarantined until the writer gives the lease back; an
expired pin is dropped.

Durability: an SSD demotion is acknowledged (the object leaves memory) only once its record
is written; SSD contents survive a restart and are re-indexed from the segment headers, and
an object read back from SSD keeps its record there until the SSD needs the space (so a
crash after a read loses nothing). Memory tiers are volatile. A disk fault degrades the SSD
tier (``degraded_tiers``): puts go on, memory evicts instead of demoting, the SSD is still
read, and :meth:`TieredStore.maintain` probes until it takes writes again.

How it is put together: the tiers, index, counters and the lock are one
:class:`~kvfabric.store.state.StoreState`; :class:`~kvfabric.store.placement.Placement` moves
objects (calling back only through :class:`~kvfabric.store.state.PlacementHooks`: lease
reclaim, inventory changes), :class:`~kvfabric.store.leases.Leases` issues and reclaims the
handles, :class:`~kvfabric.store.inventory.InventoryFeed` tells the inventory listeners.
This module finds entries, calls those parts, and owns the maintenance thread.

Locking: one re-entrant lock (``StoreState.lock``) guards the index, the tiers' allocators
and the counters. Bulk copies between memory tiers run under it (they are memcpy-fast); SSD
reads and writes run outside it, with the object marked MOVING. Within
:meth:`TieredStore.nonblocking` an operation that would wait raises WouldBlockError instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvfabric.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    KVFabricError,
    NotFoundError,
    SpecError,
    SpecMismatchError,
    WouldBlockError,
)
from kvfabric.hashing import KEY_BYTES, ROOT, chunk_keys, token_bytes, verify_chunk_tokens
from kvfabric.lookup import LookupResult
from kvfabric.memory.arena import SharedArena
from kvfabric.payload import put_whole
from kvfabric.spec import Namespace
from kvfabric.store.accounting import count_lookup, snapshot
from kvfabric.store.config import StoreConfig
from kvfabric.store.handles import ObjectReader, ObjectWriter
from kvfabric.store.index import ABORTED, MOVING, REMOVED, Entry
from kvfabric.store.inventory import InventoryFeed
from kvfabric.store.leases import Leases
from kvfabric.store.namespaces import NamespaceTable
from kvfabric.store.placement import Placement
from kvfabric.store.protocol import InventoryListener, StoredObject, TokenIds
from kvfabric.store.shards import HeadRange, HeadShards, head_mask
from kvfabric.store.ssd_usage import SsdUsage
from kvfabric.store.state import PlacementHooks, StoreState
from kvfabric.store.stats import StoreStats
from kvfabric.store.tenants import EVERY_TENANT, ArenaInfo, EveryTenant, Tenancy

log = logging.getLogger(__name__)


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
        state = self._state = StoreState(self.config, self._namespace_empty)
        self._lock = state.lock
        try:
            self._tenancy = Tenancy(self.config, state.tiers, state.names, state.index, tenants)
        except BaseException:
            state.close_tiers()
            raise
        self._namespaces = NamespaceTable(self._tenancy)
        self._feed = InventoryFeed(state.names, state.index)
        hooks = PlacementHooks(
            reclaim=lambda: self._leases.reclaim_expired(time.monotonic()),
            inventory_changed=self._feed.changed,
        )
        self._placement = Placement(state, self.config, hooks, SsdUsage(self._tenancy.ssd_limits))
        self._leases = Leases(state, self.config, self._placement, self._tenancy, self._feed)
        self._closed = False
        self._placement.recover(lambda ns: self._namespaces.intern(ns, recovering=True))
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
        tokens: bytes | TokenIds | None = None,
    ) -> ObjectWriter:
        """Allocate an object and return its writer (commit layers, or abort).

        With ``heads`` the writer writes only that KV-head range (one tensor-parallel rank):
        the other ranks reserve the same key with their own ranges and join the object
        (see :mod:`kvfabric.store.shards`).

        ``tokens``: the chunk's own token ids (int32-LE bytes or integers), kept with the
        object and reported by :meth:`inventory`. They must hash to ``key``
        (:func:`~kvfabric.hashing.verify_chunk_tokens`), or TokenMismatchError is raised and
        nothing is reserved. A rank joining an object may omit them; if the object has none
        yet, a joining rank's tokens are kept."""
        _check_key("key", key)
        _check_key("parent", parent)
        num_tokens = ns.spec.chunk_tokens if num_tokens is None else num_tokens
        nbytes = ns.spec.layout(num_tokens).nbytes  # validates num_tokens
        if heads is not None:
            head_mask(heads, ns.spec.num_kv_heads)  # validates the range
        raw_tokens = None if tokens is None else token_bytes(tokens)
        if raw_tokens is not None:  # hashed outside the lock
            verify_chunk_tokens(ns, key, parent, num_tokens, raw_tokens)
        with self._lock:
            self._check_open()
            known = self._namespaces.get(ns.seed)
            existing = None if known is None else self._state.index.find(known, key)
            if existing is not None:
                return self._join(existing, parent, num_tokens, heads, raw_tokens)
            if known is None:  # fail before allocating: a namespace over the tenant's limit
                self._tenancy.add_namespace(ns, check_only=True)
            self._tenancy.begin_write(ns.tenant_salt, check_only=True)
            tier, pages = self._placement.allocate(nbytes, ns.tenant_salt)
            try:  # allocating may have waited: the namespace may be gone, the key taken
                ns = self._namespaces.intern(ns)
                if self._state.index.find(ns, key) is not None:
                    raise AlreadyExistsError(f"{key.hex()} was stored meanwhile")
                self._tenancy.begin_write(ns.tenant_salt, check_only=True)
            except BaseException:
                self._state.tiers[tier].free(pages)  # type: ignore[union-attr]
                raise
            entry = Entry(key, parent, ns, num_tokens, tier, pages, raw_tokens)
            if heads is not None:
                entry.shards = HeadShards(ns.spec.num_kv_heads, ns.spec.num_layers)
            self._state.index.add(entry)
            writer = self._leases.new_writer(entry, heads)
            self._feed.begun(entry)
            return writer

    def _join(
        self,
        entry: Entry,
        parent: bytes,
        num_tokens: int,
        heads: HeadRange | None,
        tokens: bytes | None,
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
        writer = self._leases.new_writer(entry, heads)
        if entry.tokens is None:  # verified: they are the tokens of this very key
            entry.tokens = tokens
        return writer

    def put(
        self,
        ns: Namespace,
        key: bytes,
        data: Any,
        *,
        parent: bytes = ROOT,
        num_tokens: int | None = None,
        tokens: bytes | TokenIds | None = None,
    ) -> bool:
        """Store a whole payload in canonical layout; ``False`` if the key is already stored.
        ``tokens``: as for :meth:`reserve`."""
        return put_whole(
            lambda: self.reserve(ns, key, parent=parent, num_tokens=num_tokens, tokens=tokens),
            data,
        )

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
                if entry.flags & MOVING and entry.tier == self._state.disk_index:
                    self._state.wait(deadline, f"{key.hex()} is being read back from SSD")
                    continue
                if entry.tier != self._state.disk_index:
                    if (
                        self.config.promote_on_hit
                        and entry.tier != self._state.paged[0]
                        and entry.complete
                        and entry.pins == 0
                        and not entry.flags & MOVING
                    ):
                        self._placement.promote_in_memory(entry)
                    return self._leases.pin(entry, lease_s)
                if self._state.in_nonblocking_mode:
                    raise WouldBlockError(f"{key.hex()} must be read back from SSD")
                extent, target = entry.handle, self._placement.start_disk_promotion(entry)
            self._placement.finish_disk_promotion(entry, extent, target)

    def nonblocking(self) -> AbstractContextManager[None]:
        """Within this block (this thread only) an operation that would wait — for room, an
        SSD read, a layer — raises WouldBlockError instead, before changing anything it
        cannot finish; the daemon then repeats it on a worker thread."""
        return self._state.nonblocking()

    @property
    def in_nonblocking_mode(self) -> bool:
        """Whether this thread is inside :meth:`nonblocking` (callers that would do slow
        I/O of their own raise WouldBlockError then, as the store does)."""
        return self._state.in_nonblocking_mode

    def pin(self, ns: Namespace, key: bytes, lease_s: float) -> ObjectReader:
        """:meth:`get` with an explicit pin deadline (seconds)."""
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        return self.get(ns, key, lease_s=lease_s)

    def unpin(self, reader: ObjectReader) -> None:
        reader.release()

    # ------------------------------------------------------------------ observing

    def add_layer_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (under the store lock: it must be quick and must not call the
        store) whenever a layer is committed or a write aborted, so an event loop can wait
        for layers without parking a thread per waiter."""
        self._leases.add_layer_listener(callback)

    def add_inventory_listener(
        self, callback: InventoryListener, *, replay: bool = False, in_flight: bool = False
    ) -> None:
        """Call ``callback(stored, removed)`` whenever complete objects change: an object
        becomes complete or moves to another tier (``stored``, with its new tier; a move also
        lists the old tier in ``removed``), or is removed — deleted, evicted, aborted, dropped
        as corrupt (``removed``). Objects recovered from SSD at start are not reported: see
        :meth:`inventory`. With ``replay``, the current inventory is first reported as stored,
        atomically with the registration, so no change is missed or reordered. With
        ``in_flight`` the callback also hears of an object as soon as its write begins (as
        stored: lookups count it from then on, and readers get its layers as they land) and
        of a write abandoned before completing (as removed); not again at its completion.

        The callback runs under the store lock, on whichever thread made the change: it must
        be quick (enqueue and return), must not call the store, and should not raise (an
        exception is logged and ignored so that the store's own work completes)."""
        with self._lock:
            self._feed.add(callback, replay=replay, in_flight=in_flight)

    def inventory(self) -> Iterator[StoredObject]:
        """Every complete object as a :class:`StoredObject` (its tier's name, and its tokens
        when its writer gave them); a snapshot taken under the lock (for a republish of the
        whole inventory)."""
        with self._lock:
            return iter(self._feed.snapshot())

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
                chunks, per_tier = [0] * len(self._state.tiers), [0] * len(self._state.tiers)
            else:
                chunks, per_tier = self._state.index.prefix_counts(known, keys)
            matched, matched_chunks = sum(per_tier), sum(chunks)
            requested = matched + (len(keys) - matched_chunks) * ns.spec.chunk_tokens
            if num_tokens is not None:  # the partial last chunk's real size
                requested = max(matched, min(requested, num_tokens))
            peer = 0
            if peer_chunks > matched_chunks:
                peer = max(0, min(peer_chunks * ns.spec.chunk_tokens, requested) - matched)
            count_lookup(
                self._state, self._namespaces, known, requested, matched, per_tier, chunks, peer
            )
        return LookupResult(
            len(keys),
            matched_chunks,
            matched,
            {self._state.names[i]: n for i, n in enumerate(per_tier) if n},
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

    def contains(self, ns: Namespace, key: bytes) -> bool:
        with self._lock:
            return self._lookup_entry(ns, key) is not None

    def tier_of(self, ns: Namespace, key: bytes) -> str:
        with self._lock:
            return self._state.names[self._find(ns, key).tier]

    def delete(self, ns: Namespace, key: bytes) -> bool:
        """Remove an object (a writer in progress is aborted); ``False`` if absent."""
        with self._lock:
            entry = self._lookup_entry(ns, key)
            if entry is None:
                return False
            self._state.counters.deletes += 1
            if entry.complete:
                self._placement.drop(entry)
            else:
                self._leases.abort_entry(entry)
            return True

    def evict(self, tier: str | None = None, nbytes: int | None = None) -> int:
        """Admin: drop unpinned objects (of one tier, or from the last tier up) until
        ``nbytes`` are freed, or all of them. Returns how many were evicted (and counted)."""
        names = self._state.names
        if tier is not None and tier not in names:
            raise NotFoundError(f"no tier named {tier!r}; tiers: {names}")
        order = [names.index(tier)] if tier is not None else list(range(len(names) - 1, -1, -1))
        with self._lock:
            return self._placement.evict_unpinned(order, nbytes)

    def host_arenas(self) -> list[tuple[int, str, SharedArena]]:
        """(arena id, tier name, arena) of every shared-memory arena (the default arena of
        tier ``i`` has id ``i``): what a peer transport registers."""
        return [(a.arena_id, a.tier_name, a.arena) for a in self._tenancy.arenas()]

    def arenas(self, tenant: str | EveryTenant | None = EVERY_TENANT) -> list[ArenaInfo]:
        """The arenas a local session of ``tenant`` may map (None: the admin's default
        arenas only; no argument: every arena)."""
        return self._tenancy.arenas(tenant)

    @property
    def degraded_tiers(self) -> list[str]:
        """Names of the tiers a write fault degraded (no lock: safe on an event loop)."""
        disk = self._state.disk()
        return [self._state.names[-1]] if disk is not None and disk.degraded else []

    @property
    def tier_names(self) -> list[str]:
        return list(self._state.names)

    def __len__(self) -> int:
        return len(self._state.index)

    # ------------------------------------------------------------------ maintenance

    def maintain(self) -> None:
        """One maintenance pass: expire leases, demote above watermarks, compact the SSD
        (and, while it is degraded by a write fault, probe whether it takes writes again)."""
        disk = self._state.disk()
        if disk is not None and disk.degraded:
            disk.probe()  # rate-limited by the tier; never under the store lock
        with self._lock:
            if self._closed:
                return
            self._leases.reclaim_expired(time.monotonic())
            self._placement.maintain()
        self._placement.compact()

    def _maintain_loop(self) -> None:
        while not self._stop.wait(self.config.maintenance_interval_s):
            try:
                self.maintain()
            except Exception:  # the loop must outlive any one bad pass
                log.exception("store maintenance pass failed")

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every SSD write queued so far has completed and been indexed."""
        self._placement.flush(timeout)

    # ------------------------------------------------------------------ helpers

    def _namespace_empty(self, ns: Namespace) -> None:
        """The index's last entry of ``ns`` left (lock held); the table is built after the
        index, so the index calls it through here."""
        self._namespaces.forget(ns)

    def holds_namespace(self, ns: Namespace) -> bool:
        """Whether ``ns`` holds any object (no lock: one dict read)."""
        return ns.seed in self._namespaces

    def _lookup_entry(self, ns: Namespace, key: bytes) -> Entry | None:
        """The entry of ``key`` in ``ns``; never creates namespace state."""
        known = self._namespaces.get(ns.seed)
        return None if known is None else self._state.index.find(known, key)

    def _find(self, ns: Namespace, key: bytes) -> Entry:
        entry = self._lookup_entry(ns, key)
        if entry is not None:
            return entry
        for other in self._state.index.any_with_key(key):
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

    def stats(self) -> StoreStats:
        with self._lock:
            return snapshot(
                self._state,
                self.config,
                self._tenancy.tenants,
                self._placement.ssd_bytes_by_tenant(),
                self._namespaces.stats(),
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
        disk = self._state.disk()
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
            self._state.close_tiers(keep=disk)
            self._state.cond.notify_all()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_key(name: str, key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise SpecError(f"{name} must be {KEY_BYTES} bytes")
