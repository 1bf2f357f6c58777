"""The store as its callers see it: the :class:`Store` protocol.

The daemon's callers — the control-socket handlers, the HTTP app, the puller and pusher, the
cluster link — are typed against :class:`Store`, never against a concrete class. Two classes
implement it: :class:`~kvfabric.store.store.TieredStore` (the store itself) and
:class:`~kvfabric.server.instrumented.InstrumentedStore` (the store wrapped with metrics,
what the daemon hands its callers). ``tests/unit/store/test_protocol.py`` checks both,
statically (mypy) and by signature.

The members are exactly those the callers use; what they mean (locking, errors, which calls
may raise :class:`~kvfabric.errors.WouldBlockError` inside :meth:`Store.nonblocking`) is
documented on :class:`~kvfabric.store.store.TieredStore`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from kvfabric.hashing import ROOT
from kvfabric.spec import Namespace
from kvfabric.store.tenants import EVERY_TENANT, EveryTenant

if TYPE_CHECKING:
    from kvfabric.lookup import LookupResult
    from kvfabric.memory.arena import SharedArena
    from kvfabric.store.handles import ObjectReader, ObjectWriter
    from kvfabric.store.shards import HeadRange
    from kvfabric.store.stats import StoreStats
    from kvfabric.store.tenants import ArenaInfo


class StoredObject(NamedTuple):
    """A complete object as inventory listeners see it."""

    ns: Namespace
    key: bytes
    parent: bytes
    num_tokens: int
    tier: str  # the tier's name
    # the chunk's own token ids, int32-LE (``num_tokens * 4`` bytes); None when its writer
    # did not give them
    tokens: bytes | None


# a removed copy: (namespace, key, tier name)
RemovedObject = tuple[Namespace, bytes, str]
InventoryListener = Callable[[list[StoredObject], list[RemovedObject]], None]
# a prompt's token ids (what :func:`kvfabric.hashing.chunk_keys` hashes)
TokenIds = Sequence[int] | np.ndarray


class Store(Protocol):
    """What the daemon's callers use of a node's store."""

    # ------------------------------------------------------------------ queries

    def lookup(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        *,
        num_tokens: int | None = None,
        peer_chunks: int = 0,
    ) -> LookupResult: ...

    def lookup_tokens(
        self, ns: Namespace, tokens: TokenIds, *, peer_chunks: int = 0
    ) -> LookupResult: ...

    def contains(self, ns: Namespace, key: bytes) -> bool: ...

    def tier_of(self, ns: Namespace, key: bytes) -> str: ...

    # ------------------------------------------------------------------ writing / reading

    def reserve(
        self,
        ns: Namespace,
        key: bytes,
        *,
        parent: bytes = ROOT,
        num_tokens: int | None = None,
        heads: HeadRange | None = None,
        tokens: bytes | TokenIds | None = None,
    ) -> ObjectWriter: ...

    def get(
        self,
        ns: Namespace,
        key: bytes,
        *,
        timeout: float | None = None,
        lease_s: float | None = None,
    ) -> ObjectReader: ...

    def delete(self, ns: Namespace, key: bytes) -> bool: ...

    def evict(self, tier: str | None = None, nbytes: int | None = None) -> int: ...

    def nonblocking(self) -> AbstractContextManager[None]: ...

    @property
    def in_nonblocking_mode(self) -> bool: ...

    # ------------------------------------------------------------------ tiers and arenas

    @property
    def tier_names(self) -> list[str]: ...

    @property
    def degraded_tiers(self) -> list[str]: ...

    def arenas(self, tenant: str | EveryTenant | None = EVERY_TENANT) -> list[ArenaInfo]: ...

    def host_arenas(self) -> list[tuple[int, str, SharedArena]]: ...

    # ------------------------------------------------------------------ observing

    def stats(self) -> StoreStats: ...

    def flush(self, timeout: float = 60.0) -> None: ...

    def add_layer_listener(self, callback: Callable[[], None]) -> None: ...

    def add_inventory_listener(
        self, callback: InventoryListener, *, replay: bool = False, in_flight: bool = False
    ) -> None: ...

    def inventory(self) -> Iterator[StoredObject]: ...
