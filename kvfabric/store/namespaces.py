"""The namespaces the store holds, and their lookup counters.

A namespace is interned (:meth:`NamespaceTable.intern`) when its first object is reserved or
recovered, and forgotten (:meth:`NamespaceTable.forget`, the index's ``on_namespace_empty``
callback) when its last entry leaves: namespaces that hold nothing cost no table slot, no
tenant's namespace count and, once no namespace of a (model, tenant) pair is left, no
per-namespace counters. Lookups of a namespace the store does not hold find nothing and
create nothing. At most :data:`MAX_NAMESPACES` at once (SpecError past it); a tenant's own
namespace limit is :class:`~kvfabric.store.tenants.Tenancy`'s.

The table reads as a mapping, namespace seed -> the interned :class:`Namespace` (its
``spec`` is the one objects are stored with). Not thread-safe: the store uses it under its
lock (:meth:`NamespaceTable.holds` excepted: one dict read).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvfabric.errors import SpecError
from kvfabric.spec import Namespace
from kvfabric.store.stats import NamespaceCounters, NamespaceStats
from kvfabric.store.tenants import Tenancy

MAX_NAMESPACES = 1 << 16


class NamespaceTable(Mapping[bytes, Namespace]):
    """Namespace seed -> namespace, for the namespaces that hold objects."""

    def __init__(self, tenancy: Tenancy) -> None:
        self._tenancy = tenancy
        self._by_seed: dict[bytes, Namespace] = {}
        self._pairs: dict[tuple[str, str], int] = {}  # (model, tenant) -> namespaces held
        self._counters: dict[tuple[str, str], NamespaceCounters] = {}

    def __getitem__(self, seed: bytes) -> Namespace:
        return self._by_seed[seed]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._by_seed)

    def __len__(self) -> int:
        return len(self._by_seed)

    def holds(self, ns: Namespace) -> bool:
        """Whether ``ns`` holds any object (no lock: one dict read)."""
        return ns.seed in self._by_seed

    def intern(self, ns: Namespace, *, recovering: bool = False) -> Namespace:
        """The table's namespace equal to ``ns``, added if new (counted against its tenant's
        limit, which ``recovering`` does not enforce: records a restart finds are kept)."""
        known = self._by_seed.get(ns.seed)
        if known is not None:
            return known
        if len(self._by_seed) >= MAX_NAMESPACES:
            raise SpecError(f"too many namespaces (limit {MAX_NAMESPACES})")
        self._tenancy.add_namespace(ns, force=recovering)
        self._by_seed[ns.seed] = ns
        pair = (ns.model_id, ns.tenant_salt)
        self._pairs[pair] = self._pairs.get(pair, 0) + 1
        return ns

    def forget(self, ns: Namespace) -> None:
        """The index's last entry of ``ns`` left: forget the namespace."""
        if self._by_seed.get(ns.seed) is not ns:
            return
        del self._by_seed[ns.seed]
        self._tenancy.drop_namespace(ns)
        pair = (ns.model_id, ns.tenant_salt)
        left = self._pairs[pair] - 1
        if left:
            self._pairs[pair] = left
        else:  # no namespace of this (model, tenant) holds data: no counters, no label slot
            del self._pairs[pair]
            self._counters.pop(pair, None)

    def count_lookup(self, ns: Namespace, requested: int, hits: int) -> None:
        """A lookup in ``ns`` (one the table holds) asked for and found so many tokens."""
        counters = self._counters.setdefault((ns.model_id, ns.tenant_salt), NamespaceCounters())
        counters.lookups += 1
        counters.lookup_tokens += requested
        counters.hit_tokens += hits

    def stats(self) -> tuple[NamespaceStats, ...]:
        return tuple(
            NamespaceStats(m, t, c.lookups, c.lookup_tokens, c.hit_tokens)
            for (m, t), c in sorted(self._counters.items())
        )
