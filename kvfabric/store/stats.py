"""Counters of the tiered store and the frozen snapshots that :meth:`TieredStore.stats` returns.

Counters count tokens, not only objects: a lookup adds its matched tokens to the hit counter
of the tier each chunk was found in, the tokens past them that another node holds (a
cluster-scope lookup) to the hits as ``peer_hit_tokens``, and the rest it asked for to the
miss counter; a partial last chunk counts its real tokens when the caller says how many.
Mutable counters live inside the store (updated under its lock); callers only ever see
:class:`StoreStats` snapshots.

The snapshots are the one definition of the stats' fields: the HTTP API's bodies are derived
from them (:mod:`kvfabric.api.stats_body`), descriptions included (``described``), and the
control socket sends them as they are (``dataclasses.asdict``).
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
class StoreCounters:
    """The store's operation counters (what :class:`StoreStats` totals)."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    peer_hit_tokens: int = 0
    puts: int = 0
    gets: int = 0
    deletes: int = 0
    expired: int = 0
    aborted: int = 0


@dataclass
class NamespaceCounters:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0


def described(text: str) -> dict[str, str]:
    """A field's metadata: its description (the HTTP API's schema shows it, see
    :mod:`kvfabric.api.stats_body`)."""
    return {"description": text}


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
    bytes_saved: int = field(
        default=0, metadata=described("SSD tier in fp8: native bytes minus bytes written")
    )
    # SSD only: records skipped or refused, never served
    corrupt_records: int = 0
    torn_records: int = 0
    degraded: bool = field(
        default=False, metadata=described("SSD tier: a disk fault stopped new objects")
    )
    disk_errors: dict[str, int] = field(
        default_factory=dict, metadata=described("SSD tier: I/O errors by errno name")
    )
    refused_demotions: int = field(
        default=0,
        metadata=described(
            "SSD tier: objects evicted from memory instead of demoted while it was degraded"
        ),
    )
    quota_refused_demotions: int = field(
        default=0,
        metadata=described(
            "SSD tier: objects evicted from memory instead of demoted because their tenant's "
            "own SSD records could not make room in its quota"
        ),
    )
    # SSD records count queued or written; dead bytes awaiting compaction are nobody's
    tenant_bytes: dict[str, int] = field(
        default_factory=dict,
        metadata=described(
            "configured tenants' bytes in the tier (memory: their arena's pages in use; SSD: "
            "their records)"
        ),
    )

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


@dataclass(frozen=True, kw_only=True)
class StoreStats:
    """The totals, in the order the HTTP API lists them; then the tiers and namespaces."""

    objects: int
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    miss_tokens: int
    # the engine loads these through a pull or a push
    peer_hit_tokens: int = field(
        default=0,
        metadata=described(
            "of hit_tokens: tokens past this node's prefix that another node held "
            "(cluster-scope lookups)"
        ),
    )
    puts: int
    gets: int
    deletes: int
    expired_leases: int
    aborted_writes: int
    tiers: tuple[TierStats, ...]
    namespaces: tuple[NamespaceStats, ...] = ()

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
