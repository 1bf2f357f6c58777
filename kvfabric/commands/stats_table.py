"""A daemon's statistics as one document (the HTTP ``/v1/stats`` shape) and as a table.

The per-tenant rows sum the per-namespace counters, which exist only while the node holds
chunks of the namespace (a lookup never creates state, and an emptied namespace goes with
its counters); the totals count every lookup. What the rows miss is printed as one more
row, ``(unattributed)``, with a note saying why, so rows and totals always add up.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kvfabric.store.config import format_size

_TIER_COLUMNS = (  # header, key, width
    ("tier", "name", 8),
    ("kind", "kind", 6),
    ("capacity", "capacity_bytes", 10),
    ("used", "used_bytes", 10),
    ("used%", "utilisation", 6),
    ("objects", "objects", 8),
    ("hit tok", "hit_tokens", 9),
    ("evicted", "evictions", 8),
    ("promoted", "promotions", 9),
    ("demoted", "demotions", 8),
)


def from_store_stats(stats: dict[str, Any], *, node_id: str) -> dict[str, Any]:
    """The control socket's snapshot (``asdict(StoreStats)``) in the HTTP API's shape."""
    tiers = [
        dict(t, utilisation=_ratio(t["used_bytes"], t["capacity_bytes"])) for t in stats["tiers"]
    ]
    totals = {k: v for k, v in stats.items() if k not in ("tiers", "namespaces")}
    totals["hit_rate"] = _ratio(stats["hit_tokens"], stats["lookup_tokens"])
    totals["evictions"] = sum(t["evictions"] for t in tiers)
    namespaces = [
        {"model": n["model_id"], **{k: v for k, v in n.items() if k != "model_id"}}
        for n in stats["namespaces"]
    ]
    return {"node_id": node_id, "tiers": tiers, "totals": totals, "namespaces": namespaces}


def tenant_hit_rates(namespaces: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """tenant -> (lookups, token hit rate), over all of the tenant's models."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for ns in namespaces:
        acc = sums[ns["tenant"]]
        acc[0] += ns["lookups"]
        acc[1] += ns["hit_tokens"]
        acc[2] += ns["lookup_tokens"]
    return {
        tenant: (lookups, _ratio(hit, asked))
        for tenant, (lookups, hit, asked) in sorted(sums.items())
    }


UNATTRIBUTED = "(unattributed)"
UNATTRIBUTED_NOTE = (
    f"{UNATTRIBUTED}: lookups in namespaces this node holds no chunks of "
    "(never stored here, or emptied since); counted in the totals only"
)


def unattributed(
    totals: dict[str, Any], namespaces: list[dict[str, Any]]
) -> tuple[int, float] | None:
    """(lookups, token hit rate) of the lookups the per-namespace counters do not hold;
    None when rows and totals agree."""
    lookups = totals["lookups"] - sum(ns["lookups"] for ns in namespaces)
    if lookups <= 0:
        return None
    hit = totals["hit_tokens"] - sum(ns["hit_tokens"] for ns in namespaces)
    asked = totals["lookup_tokens"] - sum(ns["lookup_tokens"] for ns in namespaces)
    return lookups, _ratio(max(hit, 0), max(asked, 0))


def render(stats: dict[str, Any]) -> str:
    lines = [_node_line(stats), ""]
    lines += _tier_table(stats["tiers"])
    t = stats["totals"]
    peer = t.get("peer_hit_tokens", 0)  # absent from daemons that predate it
    lines += [
        "",
        (
            f"token hit rate {t['hit_rate']:.1%} ({t['hit_tokens']} of "
            f"{t['lookup_tokens']} tokens looked up, {t['lookups']} lookups"
            + (f"; {peer} of the hit tokens held by other nodes" if peer else "")
            + ")"
        ),
        (
            f"objects {t['objects']}  puts {t['puts']}  gets {t['gets']}  "
            f"deletes {t['deletes']}  evictions {t['evictions']}  "
            f"expired leases {t['expired_leases']}  aborted writes {t['aborted_writes']}"
        ),
    ]
    rates = tenant_hit_rates(stats["namespaces"])
    rest = unattributed(t, stats["namespaces"])
    if rates or rest:
        lines += ["", f"{'tenant':20} {'lookups':>8} {'hit rate':>9}"]
        lines += [
            f"{tenant or '(none)':20} {lookups:>8} {rate:>9.1%}"
            for tenant, (lookups, rate) in rates.items()
        ]
        if rest:
            lines += [f"{UNATTRIBUTED:20} {rest[0]:>8} {rest[1]:>9.1%}", UNATTRIBUTED_NOTE]
    return "\n".join(lines)


def _node_line(stats: dict[str, Any]) -> str:
    line = f"kvfabric node {stats['node_id']}"
    if "uptime_s" in stats:  # only the HTTP API knows the daemon's own state
        line += (
            f"  ({'ready' if stats['ready'] else 'NOT READY'}, up {stats['uptime_s']:.0f} s,"
            f" {stats['sessions']} sessions)"
        )
    return line


def _tier_table(tiers: list[dict[str, Any]]) -> list[str]:
    header = _row([h for h, _, _ in _TIER_COLUMNS])
    return [
        header,
        "-" * len(header),
        *(_row([_cell(key, tier[key]) for _, key, _ in _TIER_COLUMNS]) for tier in tiers),
    ]


def _row(cells: list[str]) -> str:
    """Name and kind left-aligned, numbers right-aligned."""
    return " ".join(
        f"{cell:{'<' if i < 2 else '>'}{width}}"
        for i, (cell, (_, _, width)) in enumerate(zip(cells, _TIER_COLUMNS))
    )


def _cell(key: str, value: Any) -> str:
    if key.endswith("_bytes"):
        return format_size(value)
    if key == "utilisation":
        return f"{value:.1%}"
    return str(value)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
