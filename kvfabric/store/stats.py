"""Counters of the tiered store and the frozen snapshots that :meth:`TieredStore.stats` returns.

Counters count tokens, not only objects: a lookup adds its matched tokens to the hit counter
of the tier each chunk was found in, the tokens past them that another node holds (a
cluster-scope lookup) to the hits as ``peer_hit_tokens``, and the rest it asked for to the
miss counter; a partial last chunk counts its real tokens when the caller says how many.
Mutable counters live inside the store (updated under its lock); callers only ever see
:class:`StoreStats` snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TierCounters:
    hit_tokens: int = 0
    hit_chunks: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bytes_saved: int = 0  # SSD in fp8: native bytes minus the bytes written
    refused_demotions: int = 0  # SSD: victims evicted instead because the tier was degraded
    # SSD: victims evicted instead because their tenant was at its SSD quota
    quota_refused_demotions: int = 0


@dataclass
class NamespaceCounters:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True)
class TierStats:
    name: str
    kind: str
    capacity_bytes: int
    used_bytes: int
    objects: int
    hit_tokens: int
    hit_chunks: int
    evictions: int
    promotions: int
    demotions: int
    bytes_in: int
    bytes_out: int
    bytes_saved: int = 0  # SSD in fp8: native bytes minus the bytes written
    corrupt_records: int = 0  # SSD only: records skipped or refused, never served
    torn_records: int = 0
    # SSD only: a write fault (full disk, quota, I/O error) stopped new records; the tier's
    # errors by errno name; victims evicted instead of demoted meanwhile
    degraded: bool = False
    disk_errors: dict[str, int] = field(default_factory=dict)
    refused_demotions: int = 0
    quota_refused_demotions: int = 0  # SSD only: victims evicted at their tenant's SSD quota
    # configured tenants' bytes here: memory tiers, their arena's pages in use (host tiers);
    # SSD, their records (queued or written; dead bytes awaiting compaction are nobody's)
    tenant_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def utilisation(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


@dataclass(frozen=True)
class NamespaceStats:
    model_id: str
    tenant: str
    lookups: int
    lookup_tokens: int
    hit_tokens: int


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    objects: int
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    miss_tokens: int
    puts: int
    gets: int
    deletes: int
    expired_leases: int
    aborted_writes: int
    namespaces: tuple[NamespaceStats, ...] = field(default=())
    # of hit_tokens: tokens past this node's prefix that another node held (cluster-scope
    # lookups; the engine then loads them through a pull or a push)
    peer_hit_tokens: int = 0

    @property
    def degraded_tiers(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers if t.degraded)

    def tier(self, name: str) -> TierStats:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    @property
    def evictions(self) -> int:
        return sum(t.evictions for t in self.tiers)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
