"""The store's accounting: what a lookup counts, and the :class:`StoreStats` snapshot.

What the counters mean is :mod:`kvfabric.store.stats`; they live in the store's
:class:`~kvfabric.store.state.StoreState` (tier and operation counters) and its
:class:`~kvfabric.store.namespaces.NamespaceTable` (per namespace). Both functions are called
by :class:`~kvfabric.store.store.TieredStore` with the store lock held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfabric.spec import Namespace
from kvfabric.store.config import StoreConfig
from kvfabric.store.namespaces import NamespaceTable
from kvfabric.store.state import StoreState
from kvfabric.store.stats import NamespaceStats, StoreStats, TierStats
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.host import HostTier


def count_lookup(
    state: StoreState,
    namespaces: NamespaceTable,
    ns: Namespace | None,
    requested: int,
    matched: int,
    per_tier: list[int],
    chunks: list[int],
    peer: int = 0,
) -> None:
    """A lookup asked for ``requested`` tokens and found ``matched`` (``per_tier`` tokens and
    ``chunks`` per tier) here and ``peer`` more on another node; ``ns``: the table's
    namespace, None if it holds none (then no per-namespace counter is made)."""
    count = state.counters
    count.lookups += 1
    count.lookup_tokens += requested
    count.hit_tokens += matched + peer
    count.peer_hit_tokens += peer
    count.miss_tokens += requested - matched - peer
    for i, tokens in enumerate(per_tier):
        if tokens:
            state.tier_counters[i].hit_tokens += tokens
            state.tier_counters[i].hit_chunks += chunks[i]
    if ns is not None:
        namespaces.count_lookup(ns, requested, matched + peer)


def snapshot(
    state: StoreState,
    config: StoreConfig,
    tenants: Sequence[str],
    ssd_tenant_bytes: dict[str, int],
    namespaces: tuple[NamespaceStats, ...],
) -> StoreStats:
    """The store's stats now: per tier (``tenants``' bytes in each host tier, and
    ``ssd_tenant_bytes`` on the SSD), the totals, and ``namespaces``."""
    tiers = []
    for i, tier in enumerate(state.tiers):
        c = state.tier_counters[i]
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
                "tenant_bytes": ssd_tenant_bytes,
            }
        elif isinstance(tier, HostTier):
            extra = {"tenant_bytes": {t: tier.pool_used_bytes(t) for t in tenants}}
        tiers.append(
            TierStats(
                name=state.names[i],
                kind=config.tiers[i].kind.value,
                capacity_bytes=tier.capacity_bytes,
                used_bytes=tier.used_bytes,
                objects=state.index.tier_count(i),
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
    count = state.counters
    return StoreStats(
        tiers=tuple(tiers),
        objects=len(state.index),
        lookups=count.lookups,
        lookup_tokens=count.lookup_tokens,
        hit_tokens=count.hit_tokens,
        miss_tokens=count.miss_tokens,
        peer_hit_tokens=count.peer_hit_tokens,
        puts=count.puts,
        gets=count.gets,
        deletes=count.deletes,
        expired_leases=count.expired,
        aborted_writes=count.aborted,
        namespaces=namespaces,
    )
