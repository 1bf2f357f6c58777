"""Plan the Redis global index for N nodes: entries, bytes, shards, rates, what saturates first.

Who calls: ``kvfabric plan scale`` (prints the plans with :mod:`kvfabric.planning.scale_report`),
the benchmarks (``plan_10k_redis_shards`` is :attr:`ScalePlan.shards` of
:data:`~kvfabric.planning.scale_inputs.REFERENCE_10K`) and ``docs/capacity-plan-10k.md``.
Pure arithmetic: no I/O, no clock; the same
:class:`~kvfabric.planning.scale_inputs.ScaleInputs` (the workload and the deployment),
:class:`~kvfabric.planning.scale_inputs.OpCosts` (per-operation costs measured on one Redis
server by :mod:`kvfabric.planning.opcosts`) and
:class:`~kvfabric.planning.scale_inputs.ShardBudget` (what one shard and one node may be
given) always give the same :class:`ScalePlan`.

Units as in :mod:`kvfabric.planning.scale_inputs` (bad inputs raise
:class:`~kvfabric.errors.SpecError` when built there; nothing here raises); the load at a
node count, and the layout and traffic it assumes, are :mod:`kvfabric.planning.scale_load`'s.

Shards: a namespace, the registry and the stream are one slot each, and Redis Cluster never
splits a slot, so shards beyond ``namespaces + 2`` hold nothing; the hottest namespace, the
registry and the stream must each fit one shard whatever the shard count. The plan gives
the shards the total load needs as if it could be spread (by memory and by CPU, whichever
binds) and, per component, the node count at which it runs out of its budget with those
shards. A single-slot or per-node component over its budget makes the plan infeasible at
any shard count (:attr:`ScalePlan.blocked_by`): the layout, not the shard count, must change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvfabric.planning.scale_inputs import OpCosts, ScaleInputs, ShardBudget
from kvfabric.planning.scale_load import Load, OpLoad, load_at

MAX_NODES = 10**9  # the saturation search stops here: "does not saturate" past it

# the components a plan checks (ScalePlan.saturation lists them first-to-saturate first)
REDIS_MEMORY = "redis memory"
REDIS_OPS = "redis ops"
HOT_NAMESPACE = "hot namespace slot"
REGISTRY = "registry slot"
EVENT_STREAM = "event stream slot"
EVENT_CONSUMERS = "event path consumers"
DAEMON_LOOKUP = "daemon HTTP lookup"
LOOKUP_NETWORK = "network for lookups"


@dataclass(frozen=True)
class Saturation:
    """One component against its budget: ``utilization`` at the plan's node count (1.0 is
    the budget; the larger of its resources), the ``resource`` that binds there, and the
    smallest node count at which it reaches its budget with the plan's shards (None: not
    below :data:`MAX_NODES`)."""

    component: str
    resource: str
    utilization: float
    saturates_at_nodes: int | None


@dataclass(frozen=True)
class ScalePlan:
    """What ``nodes`` nodes need of the Redis global index; see the module docstring (the
    shards, the saturation) and :mod:`kvfabric.planning.scale_load`'s (the load)."""

    nodes: int
    requests_per_s: float  # cluster-wide
    new_chunks_per_s: float
    owner_entries: float  # (chunk, node, tier) copies indexed
    index_entries: float  # distinct chunks: owners / meta hash fields
    bytes_per_entry: float  # index bytes per distinct chunk, its copies included
    index_bytes: float  # owners + meta hashes
    live_bytes: float  # namespaces' live hashes
    registry_bytes: float
    stream_bytes: float
    memory_bytes: float  # all of the above
    lookups_per_s: float
    lookup_wall_s: float  # one cluster lookup's latency at the daemon, the index idle
    index_writes_per_s: float  # chunk updates (stored or removed) applied by the index
    kv_events_per_s: float  # stream entries appended
    redis_commands_per_s: float  # top-level commands, followers' XREADs left out (they batch)
    ops: tuple[OpLoad, ...]
    redis_busy: float  # Redis main-thread seconds per second, every slot
    shards_by_memory: int
    shards_by_ops: int
    shards: int
    shards_bound_by: str  # "memory", "ops" or "minimum"
    useful_shards: int  # slots in use: namespaces + registry + stream
    saturation: tuple[Saturation, ...]  # first to saturate first
    first_saturating: str
    first_saturation_nodes: int | None
    blocked_by: tuple[str, ...]  # components over budget at ``nodes``
    notes: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        """Whether every component fits its budget at ``nodes`` with ``shards`` shards."""
        return not self.blocked_by


Usage = tuple[str, float]  # (resource, utilization)
Meter = Callable[[Load], Usage]


def _worst(*usages: Usage) -> Usage:
    return max(usages, key=lambda u: u[1])


def _meters(shards: int, budget: ShardBudget) -> dict[str, Meter]:
    """Each component's utilization (1.0 = its budget) at a load; shards held fixed."""
    nic = budget.nic_bytes_per_s * budget.nic_headroom
    cpu = budget.cpu_headroom
    return {
        REDIS_MEMORY: lambda x: ("memory", x.memory / (shards * budget.memory_bytes)),
        REDIS_OPS: lambda x: ("cpu", x.busy() / (shards * cpu)),
        # one slot each: no shard count spreads them
        HOT_NAMESPACE: lambda x: _worst(
            ("memory", x.hot_memory / budget.memory_bytes), ("cpu", x.hot_busy / cpu)
        ),
        REGISTRY: lambda x: _worst(
            ("cpu", x.busy("registry") / cpu), ("network", x.registry_egress / nic)
        ),
        EVENT_STREAM: lambda x: _worst(
            ("cpu", x.busy("stream") / cpu),
            ("memory", x.stream_bytes / budget.memory_bytes),
            ("network", x.stream_egress / nic),
        ),
        # per node: no shard count helps either
        EVENT_CONSUMERS: lambda x: _worst(
            ("cpu", x.consumer_cpu / budget.follower_cores),
            ("memory", x.consumer_memory / budget.node_memory_bytes),
        ),
        DAEMON_LOOKUP: lambda x: ("cpu", x.daemon_lookup_cpu / budget.lookup_cores),
        LOOKUP_NETWORK: lambda x: ("network", x.hot_lookup_egress / nic),
    }


def _saturates_at(inputs: ScaleInputs, costs: OpCosts, meter: Meter) -> int | None:
    """Smallest node count whose utilization reaches 1 (every load grows with nodes)."""

    def over(n: int) -> bool:
        return meter(load_at(replace(inputs, nodes=n), costs))[1] >= 1.0

    if over(1):
        return 1
    low, high = 1, 2
    while not over(high):
        if high >= MAX_NODES:
            return None
        low, high = high, min(high * 2, MAX_NODES)
    while high - low > 1:  # over(high) and not over(low)
        mid = (low + high) // 2
        low, high = (low, mid) if over(mid) else (mid, high)
    return high


def plan_scale(
    inputs: ScaleInputs, costs: OpCosts, shard_budget: ShardBudget | None = None
) -> ScalePlan:
    """The plan for ``inputs.nodes`` nodes, from the load
    :func:`~kvfabric.planning.scale_load.load_at` gives at that count.

    Shards: by memory, the whole index over the per-shard memory budget; by ops, the
    main-thread seconds per second of every operation over the per-shard CPU headroom; the
    larger (at least ``min_shards``) is the plan. Single-slot components (the hot namespace,
    the registry, the stream) and per-node ones are checked on their own: no shard count
    helps them, so they say the plan is not feasible (:attr:`ScalePlan.blocked_by`).
    """
    budget = shard_budget or ShardBudget()
    load = load_at(inputs, costs)
    by_memory = math.ceil(load.memory / budget.memory_bytes)
    by_ops = math.ceil(load.busy() / budget.cpu_headroom)
    shards = max(budget.min_shards, by_memory, by_ops)
    if shards == budget.min_shards > max(by_memory, by_ops):
        bound = "minimum"
    else:
        bound = "memory" if by_memory >= by_ops else "ops"
    useful = inputs.namespaces + 2

    rows = []
    for name, meter in _meters(shards, budget).items():
        resource, utilization = meter(load)
        rows.append(Saturation(name, resource, utilization, _saturates_at(inputs, costs, meter)))
    order = sorted(rows, key=lambda s: (s.saturates_at_nodes or MAX_NODES + 1, -s.utilization))

    notes = []
    if shards > useful:
        notes.append(
            f"{shards} shards but only {useful} slots in use (each namespace, the registry "
            "and the stream are one slot): shards past that stay empty"
        )
    if costs.chunk_tokens != inputs.chunk_tokens:
        notes.append(
            f"costs were measured with {costs.chunk_tokens}-token chunks, the workload has "
            f"{inputs.chunk_tokens}: stream and follower costs scale with the token ids"
        )
    return ScalePlan(
        nodes=inputs.nodes,
        requests_per_s=inputs.nodes * inputs.requests_per_node_s,
        new_chunks_per_s=load.new_chunks_s,
        owner_entries=load.owner_entries,
        index_entries=load.entries,
        bytes_per_entry=load.index_bytes / load.entries,
        index_bytes=load.index_bytes,
        live_bytes=load.live_bytes,
        registry_bytes=load.registry_bytes,
        stream_bytes=load.stream_bytes,
        memory_bytes=load.memory,
        lookups_per_s=load.lookups_s,
        lookup_wall_s=load.lookup_wall_s,
        index_writes_per_s=load.writes_s,
        kv_events_per_s=load.events_s,
        redis_commands_per_s=load.commands_s,
        ops=load.ops,
        redis_busy=load.busy(),
        shards_by_memory=by_memory,
        shards_by_ops=by_ops,
        shards=shards,
        shards_bound_by=bound,
        useful_shards=useful,
        saturation=tuple(order),
        first_saturating=order[0].component,
        first_saturation_nodes=order[0].saturates_at_nodes,
        blocked_by=tuple(s.component for s in order if s.utilization >= 1.0),
        notes=tuple(notes),
    )


def saturation_curve(
    inputs: ScaleInputs,
    costs: OpCosts,
    node_counts: Sequence[int] = (10, 100, 1000, 10_000),
    shard_budget: ShardBudget | None = None,
) -> list[ScalePlan]:
    """One plan per node count, the rest of ``inputs`` unchanged (per-node rates and
    capacities stay per node, so the cluster's load grows with it)."""
    return [plan_scale(replace(inputs, nodes=n), costs, shard_budget) for n in node_counts]
