"""Human tables of scale plans: what ``kvfabric plan scale`` prints.

Who calls: ``kvfabric plan scale`` and ``docs/capacity-plan-10k.md`` (:func:`render_table` of
one :class:`~kvfabric.planning.scale.ScalePlan`, :func:`render_curve` of
:func:`~kvfabric.planning.scale.saturation_curve`'s plans). Pure formatting, no I/O: rates and
counts with 3 significant digits and a k/M/G suffix, bytes in binary units (KiB, MiB, GiB),
latencies in ms, per-operation costs in us; a saturation past
:data:`~kvfabric.planning.scale.MAX_NODES` reads ``>1 G``. Nothing here raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvfabric.planning.scale import MAX_NODES, ScalePlan


def _si(value: float, unit: str = "") -> str:
    """3 significant digits with a k/M/G/T suffix (bytes in binary units)."""
    if math.isinf(value):
        return "inf"
    base, names = (
        (1024.0, ("", "Ki", "Mi", "Gi", "Ti", "Pi"))
        if unit == "B"
        else (
            1000.0,
            ("", "k", "M", "G", "T", "P"),
        )
    )
    i = 0
    while abs(value) >= base and i < len(names) - 1:
        value /= base
        i += 1
    return f"{value:.3g} {names[i]}{unit}".rstrip()


def _nodes(n: int | None) -> str:
    return f">{_si(MAX_NODES)}" if n is None else f"{n:,}"


def render_table(plan: ScalePlan) -> str:
    """A human table of one plan (what ``kvfabric plan scale`` prints)."""
    stores = " / ".join(
        _si(b, "B") for b in (plan.live_bytes, plan.registry_bytes, plan.stream_bytes)
    )
    rows = [
        ("nodes", f"{plan.nodes:,}"),
        ("requests/s (cluster)", _si(plan.requests_per_s)),
        ("new chunks/s", _si(plan.new_chunks_per_s)),
        ("index entries (distinct chunks)", _si(plan.index_entries)),
        ("owner entries (copies)", _si(plan.owner_entries)),
        ("bytes per entry (copies included)", f"{plan.bytes_per_entry:.0f}"),
        ("index memory (owners + meta)", _si(plan.index_bytes, "B")),
        ("live hashes / registry / stream", stores),
        ("Redis memory, total", _si(plan.memory_bytes, "B")),
        ("lookups/s", _si(plan.lookups_per_s)),
        ("one lookup, idle index", f"{plan.lookup_wall_s * 1e3:.3g} ms"),
        ("index writes/s (chunk updates)", _si(plan.index_writes_per_s)),
        ("KV events/s", _si(plan.kv_events_per_s)),
        ("Redis commands/s (no XREADs)", _si(plan.redis_commands_per_s)),
        ("Redis busy (main-thread s/s)", f"{plan.redis_busy:.3g}"),
        ("shards by memory / by ops", f"{plan.shards_by_memory:,} / {plan.shards_by_ops:,}"),
        ("Redis Cluster shards", f"{plan.shards:,} (bound by {plan.shards_bound_by})"),
        ("slots in use", f"{plan.useful_shards:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    op_width = max(len(o.op) for o in plan.ops)
    lines += ["", f"{'operation':<{op_width}}  {'slot':<9} {'per s':>8} {'us each':>8} {'busy':>8}"]
    for o in plan.ops:
        lines.append(
            f"{o.op:<{op_width}}  {o.slot:<9} {_si(o.per_s):>8} {o.server_s * 1e6:>8.3g} "
            f"{o.busy:>8.3g}"
        )
    lines += ["", f"{'component':<22}{'binds on':<10}{'use now':>10}  saturates at nodes"]
    for s in plan.saturation:
        lines.append(
            f"{s.component:<22}{s.resource:<10}{s.utilization:>10.3g}  "
            f"{_nodes(s.saturates_at_nodes)}"
        )
    lines.append("")
    lines.append(
        f"first to saturate: {plan.first_saturating} at {_nodes(plan.first_saturation_nodes)} nodes"
    )
    if plan.blocked_by:
        lines.append(f"over budget at {plan.nodes:,} nodes: {', '.join(plan.blocked_by)}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def render_curve(plans: Sequence[ScalePlan]) -> str:
    """One row per plan of :func:`saturation_curve`."""
    head = (
        f"{'nodes':>7} {'entries':>8} {'memory':>10} {'lookups/s':>10} {'events/s':>9} "
        f"{'busy':>7} {'shards':>6} {'by':>7}  first saturating (at nodes)"
    )
    rows = [
        f"{p.nodes:>7,} {_si(p.index_entries):>8} {_si(p.memory_bytes, 'B'):>10} "
        f"{_si(p.lookups_per_s):>10} {_si(p.kv_events_per_s):>9} {p.redis_busy:>7.3g} "
        f"{p.shards:>6} {p.shards_bound_by:>7}  {p.first_saturating} "
        f"({_nodes(p.first_saturation_nodes)})"
        for p in plans
    ]
    return "\n".join([head, *rows])
