"""A :class:`~kvfabric.store.TieredStore` (and the pusher) wrapped with metrics, without
touching their code.

:class:`InstrumentedStore` has the store's method names and signatures and delegates every
call. Around ``lookup``, ``lookup_tokens``, ``reserve``, ``put``, ``get``, ``pin``,
``contains``, ``delete`` and ``evict`` it records the latency (label ``op``, the method name)
and, when the call raises, the error kind; the exception itself propagates unchanged. Each
successful lookup also counts **tokens**: the tokens asked for and missed per tenant
(``ns.tenant_salt``; a namespace that holds nothing counts under ``OTHER_TENANT``), and the
tokens found per (tier, tenant) from :attr:`~kvfabric.store.LookupResult.tier_tokens`,
plus those another node holds (a cluster-scope lookup) under tier :data:`PEER_TIER`.
:class:`InstrumentedPuller` counts the chunks and tokens pulled from other nodes. Both
the puller and the pusher also note each move in the recent-transfers ring
(:mod:`kvfabric.api.transfers`) when given one.

The rest of the :class:`~kvfabric.store.protocol.Store` protocol (``stats``, ``flush``,
``tier_of``, ``tier_names``, ``nonblocking``, the listeners, ...) is delegated as is, so the
daemon can hand this object to every caller as "the store". Nothing else is: the store's
lifecycle and admin (``close``, ``maintain``, ``len()``) stay with its owner, through
:attr:`InstrumentedStore.store`.

(The pattern is llm-d's ``instrumented_index.go``: wrap a backend instead of sprinkling
metrics through it.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

from kvfabric.api.metrics import OTHER_TENANT, Metrics, error_kind
from kvfabric.api.transfers import RecentTransfers
from kvfabric.errors import WouldBlockError
from kvfabric.hashing import ROOT
from kvfabric.memory.arena import SharedArena
from kvfabric.server.puller import PrefetchResult, Puller
from kvfabric.server.pusher import Pusher, PushResult
from kvfabric.spec import Namespace
from kvfabric.store import LookupResult, ObjectReader, ObjectWriter, StoreStats, TieredStore
from kvfabric.store.protocol import InventoryListener, StoredObject, TokenIds
from kvfabric.store.shards import HeadRange
from kvfabric.store.tenants import EVERY_TENANT, ArenaInfo, EveryTenant

T = TypeVar("T")
P = ParamSpec("P")
# the hit "tier" of tokens another node holds (a cluster-scope lookup's hit past the local
# prefix: the engine loads them through a pull or a push)
PEER_TIER = "peer"


class InstrumentedStore:
    """Delegates to ``store``; records latency, errors and lookup tokens in ``metrics``."""

    def __init__(self, store: TieredStore, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics

    @property
    def store(self) -> TieredStore:
        """The wrapped store."""
        return self._store

    def _timed(self, op: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)``, timed. (A plain call, not a context manager: entering and
        leaving a generator-based one costs ~2 us, on every store call the daemon makes.)"""
        started = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except WouldBlockError:
            raise  # not an outcome: the daemon retries the same call on a worker thread
        except Exception as exc:
            self._metrics.observe_store_op(op, time.perf_counter() - started, error_kind(exc))
            raise
        self._metrics.observe_store_op(op, time.perf_counter() - started, None)
        return result

    def _count(self, ns: Namespace, result: LookupResult) -> LookupResult:
        found = dict(result.tier_tokens)
        if result.peer_tokens:
            found[PEER_TIER] = result.peer_tokens
        # a tenant label only for namespaces that hold data: lookups with made-up tenant
        # salts must not use up the capped label slots (OTHER_TENANT counts them)
        tenant = ns.tenant_salt if self._store.holds_namespace(ns) else OTHER_TENANT
        self._metrics.count_lookup(tenant, result.requested_tokens, found)
        return result

    # ------------------------------------------------------------------ queries

    def lookup(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        *,
        num_tokens: int | None = None,
        peer_chunks: int = 0,
    ) -> LookupResult:
        return self._count(
            ns,
            self._timed(
                "lookup",
                self._store.lookup,
                ns,
                keys,
                num_tokens=num_tokens,
                peer_chunks=peer_chunks,
            ),
        )

    def lookup_tokens(
        self, ns: Namespace, tokens: TokenIds, *, peer_chunks: int = 0
    ) -> LookupResult:
        return self._count(
            ns,
            self._timed(
                "lookup_tokens", self._store.lookup_tokens, ns, tokens, peer_chunks=peer_chunks
            ),
        )

    def contains(self, ns: Namespace, key: bytes) -> bool:
        return self._timed("contains", self._store.contains, ns, key)

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
        return self._timed(
            "reserve",
            self._store.reserve,
            ns,
            key,
            parent=parent,
            num_tokens=num_tokens,
            heads=heads,
            tokens=tokens,
        )

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
        return self._timed(
            "put",
            self._store.put,
            ns,
            key,
            data,
            parent=parent,
            num_tokens=num_tokens,
            tokens=tokens,
        )

    def delete(self, ns: Namespace, key: bytes) -> bool:
        return self._timed("delete", self._store.delete, ns, key)

    def evict(self, tier: str | None = None, nbytes: int | None = None) -> int:
        return self._timed("evict", self._store.evict, tier, nbytes)

    # ------------------------------------------------------------------ reading

    def get(
        self,
        ns: Namespace,
        key: bytes,
        *,
        timeout: float | None = None,
        lease_s: float | None = None,
    ) -> ObjectReader:
        return self._timed("get", self._store.get, ns, key, timeout=timeout, lease_s=lease_s)

    def pin(self, ns: Namespace, key: bytes, lease_s: float) -> ObjectReader:
        return self._timed("pin", self._store.pin, ns, key, lease_s)

    # ------------------------------------------------------------------ delegated as is

    def tier_of(self, ns: Namespace, key: bytes) -> str:
        return self._store.tier_of(ns, key)

    def nonblocking(self) -> AbstractContextManager[None]:
        return self._store.nonblocking()

    @property
    def in_nonblocking_mode(self) -> bool:
        return self._store.in_nonblocking_mode

    @property
    def tier_names(self) -> list[str]:
        return self._store.tier_names

    @property
    def degraded_tiers(self) -> list[str]:
        return self._store.degraded_tiers

    def arenas(self, tenant: str | EveryTenant | None = EVERY_TENANT) -> list[ArenaInfo]:
        return self._store.arenas(tenant)

    def host_arenas(self) -> list[tuple[int, str, SharedArena]]:
        return self._store.host_arenas()

    def stats(self) -> StoreStats:
        return self._store.stats()

    def flush(self, timeout: float = 60.0) -> None:
        self._store.flush(timeout)

    def add_layer_listener(self, callback: Callable[[], None]) -> None:
        self._store.add_layer_listener(callback)

    def add_inventory_listener(
        self, callback: InventoryListener, *, replay: bool = False, in_flight: bool = False
    ) -> None:
        self._store.add_inventory_listener(callback, replay=replay, in_flight=in_flight)

    def inventory(self) -> Iterator[StoredObject]:
        return self._store.inventory()


class InstrumentedPusher:
    """Delegates pushes to a :class:`~kvfabric.server.pusher.Pusher`; counts their chunks
    per outcome and target hardware class (``kvfabric_push_chunks_total``), the bytes they
    moved (``kvfabric_push_bytes_total``), and observes how
    each kept up with its producer (``kvfabric_push_landed_fraction``,
    ``kvfabric_push_tail_seconds``)."""

    def __init__(
        self, pusher: Pusher, metrics: Metrics, transfers: RecentTransfers | None = None
    ) -> None:
        """``transfers``: each push that moved or failed chunks is recorded there too."""
        self._pusher = pusher
        self._metrics = metrics
        self._transfers = transfers

    def push(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        target: str,
        timeout: float,
        *,
        wire: str | None = None,
    ) -> PushResult:
        started = time.perf_counter()
        result = self._pusher.push(ns, keys, target, timeout, wire=wire)
        if self._transfers is not None and (result.pushed or result.failed):
            self._transfers.record(
                "push",
                target,
                result.pushed,
                nbytes=result.wire_bytes,
                failed=result.failed,
                seconds=time.perf_counter() - started,
            )
        self._metrics.count_push(
            result.target_class, result.pushed, result.already_there, result.failed
        )
        self._metrics.count_push_bytes(result.target_class, result.wire_bytes, result.native_bytes)
        if result.timeline is not None:
            timeline = result.timeline
            self._metrics.observe_push_timeline(
                result.target_class, timeline.landed_fraction, timeline.tail_s
            )
        return result


class InstrumentedPuller:
    """Delegates prefetches to a :class:`~kvfabric.server.puller.Puller`; counts their
    chunks per outcome and the tokens pulled (``kvfabric_pull_chunks_total``,
    ``kvfabric_pull_tokens_total``)."""

    def __init__(
        self, puller: Puller, metrics: Metrics, transfers: RecentTransfers | None = None
    ) -> None:
        """``transfers``: each prefetch that copied or missed chunks is recorded there too."""
        self._puller = puller
        self._metrics = metrics
        self._transfers = transfers

    def prefetch(self, ns: Namespace, keys: Sequence[bytes], timeout: float) -> PrefetchResult:
        started = time.perf_counter()
        result = self._puller.prefetch(ns, keys, timeout)
        if self._transfers is not None and (result.pulled or result.missing):
            self._transfers.record(
                "pull",
                result.source or "",
                result.pulled,
                tokens=result.pulled_tokens,
                failed=result.missing,
                seconds=time.perf_counter() - started,
            )
        self._metrics.count_pull(
            result.pulled, result.already_local, result.missing, result.pulled_tokens
        )
        return result
