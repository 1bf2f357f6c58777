"""Plan the Redis global index for N nodes: entries, bytes, shards, rates, what saturates first.

Who calls: ``kvfabric plan scale`` (prints :func:`render_table` / :func:`render_curve`), the
benchmarks (``plan_10k_redis_shards`` is :attr:`ScalePlan.shards` of :data:`REFERENCE_10K`)
and ``docs/capacity-plan-10k.md``. Pure arithmetic: no I/O, no clock; the same
:class:`ScaleInputs` (the workload and the deployment), :class:`OpCosts` (per-operation costs
measured on one Redis server by :mod:`kvfabric.planning.opcosts`) and :class:`ShardBudget`
(what one shard and one node may be given) always give the same :class:`ScalePlan`.

Units: bytes, seconds, per-second rates; request rates are **per node** (the cluster's rate is
``nodes * requests_per_node_s``); node and shard counts are ints. Bad inputs (negative
rates, shares outside [0, 1], no capacity at all) raise :class:`~kvfabric.errors.SpecError`.

The layout assumed is the one :mod:`kvfabric.cluster.redis_index` writes (see there):

* per namespace (hash tag ``{seed}``, **one Redis Cluster slot**): an ``owners`` hash (one
  field per distinct chunk, its value every copy's ``node|epoch|tier`` joined by ``,``), a
  ``meta`` hash (one field per chunk: parent key + u32 token count) and a ``live`` hash (one
  field per node that ever published in it; never trimmed);
* the registry (``{reg}``, one slot): a live hash, and per node its info hash, epoch counter
  and seeds set;
* the event stream (``{events}``, one slot): every stored run / removal of every node,
  ``XADD MAXLEN ~ max_events``, stored runs with their token ids.

and the traffic the code makes (``kvfabric.server``):

* a lookup is one script on the namespace's slot: ``HMGET`` of the chain plus ``HGETALL``
  of the namespace's live hash, so its cost grows with the nodes in the namespace;
* a node's store publishes one update per (chunk, tier) stored and one per removal; with
  memory full, every new chunk is eventually removed from every tier it passed through
  (DRAM, then SSD by demotion), so ``2 * tiers`` updates per new chunk;
* every node renews its leases every ``heartbeat_s`` (one script on the registry and one per
  namespace it published in), follows the whole event stream (``kv_events.remote``, on by
  default with the Redis index: every node reads every event) and lists the live nodes
  (``nodes()``: the registry's live hash plus one ``HGETALL`` per node) every
  ``heartbeat_s`` for the follower and every ``classes_refresh_s`` for the hardware
  classes its cluster lookups report.

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

from kvfabric.errors import SpecError
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, KVSpec

GiB = 1 << 30
TiB = 1 << 40
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


def _positive(obj: object, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise SpecError(f"{name} must be positive, got {getattr(obj, name)!r}")


def _nonnegative(obj: object, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) >= 0:
            raise SpecError(f"{name} must be >= 0, got {getattr(obj, name)!r}")


def _share(obj: object, *names: str) -> None:
    for name in names:
        if not 0 <= getattr(obj, name) <= 1:
            raise SpecError(f"{name} must be in [0, 1], got {getattr(obj, name)!r}")


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float, planes: int = 2
) -> float:
    """KV bytes one token adds: ``planes`` (K and V: 2; MLA's latent: 1) x layers x KV heads
    x head_dim x dtype bytes."""
    return float(planes * num_layers * num_kv_heads * head_dim * dtype_bytes)


def kv_bytes_per_token_of(spec: KVSpec) -> float:
    """Bytes per token of a full chunk of ``spec`` as kvfabric stores it (float8's per-head
    scales included, which :func:`kv_bytes_per_token` leaves out)."""
    return spec.chunk_bytes / spec.chunk_tokens


@dataclass(frozen=True)
class LinearCost:
    """A cost of one lookup-shaped operation: ``base + per_chunk * chunks + per_live_node *
    live_nodes`` (chunks of the chain asked, nodes in the namespace's live hash)."""

    base: float
    per_chunk: float = 0.0
    per_live_node: float = 0.0

    def at(self, chunks: float, live_nodes: float) -> float:
        return self.base + self.per_chunk * chunks + self.per_live_node * live_nodes


@dataclass(frozen=True)
class OpCosts:
    """Per-operation costs of kvfabric's Redis index and event path, measured on one Redis
    server (:func:`kvfabric.planning.opcosts.measure_opcosts`).

    ``*_server_s``: CPU seconds of the Redis main thread (``INFO cpu``: command execution
    plus its socket I/O), what saturates a shard. ``*_cpu_s``: CPU seconds of the calling
    thread on the node (``time.thread_time``), what a daemon's one interpreter pays. Bytes:
    ``MEMORY USAGE`` (memory) or ``INFO stats`` net counters (network). A "stored event" is
    one chain run of ``run_chunks`` chunks with their token ids; the plan scales it per chunk.
    """

    # Redis commands (top-level, as the server counts them)
    commands_per_lookup: float
    commands_per_publish_batch: float
    # Redis main-thread CPU seconds
    lookup_server_s: LinearCost
    store_server_s: float  # per chunk stored (its share of the update script)
    remove_server_s: float  # per chunk removed
    xadd_server_s: float  # per event appended to the stream (execution only)
    stored_event_read_server_s: float  # per stored event a follower reads (XREAD, XRANGE)
    removed_event_read_server_s: float  # per removal event a follower reads
    heartbeat_server_s: float  # per lease renewal script (the registry's or one namespace's)
    nodes_server_s_per_node: float  # nodes(): per registered node listed
    # memory (bytes)
    bytes_per_entry: float  # owners + meta fields of one chunk with one copy
    bytes_per_extra_copy: float  # one more copy of a chunk already indexed
    bytes_per_live_field: float  # one node's field in a namespace's live hash
    bytes_per_registered_node: float  # registry: info hash, epoch, seeds set, live field
    stream_bytes_per_stored_event: float
    stream_bytes_per_removed_event: float
    # network (bytes out of Redis)
    lookup_reply_bytes: LinearCost
    stored_event_read_bytes: float  # per stored event a follower reads
    removed_event_read_bytes: float
    nodes_reply_bytes_per_node: float
    # event path
    events_per_chunk: float  # stored events per chunk of a run (chain runs share an event)
    event_encode_s: float  # per stored event, kvfabric.cluster.events.encode
    event_decode_s: float  # per stored event, kvfabric.cluster.events.decode
    consumer_cpu_s_per_stored: float  # a follower, per stored chunk: read, decode, apply, wire
    consumer_cpu_s_per_removed: float  # a follower, per removed chunk
    remote_inventory_bytes_per_chunk: float  # a follower's memory per remote chunk
    # node side
    lookup_client_cpu_s: LinearCost
    lookup_client_wall_s: LinearCost  # latency, reported only
    nodes_client_cpu_s_per_node: float
    register_client_s: float  # reported only: once per daemon start
    # conditions of the measurement
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    node_id_chars: int = 24
    run_chunks: int = 8  # chunks per stored event measured (one request's new chunks)
    http_overhead_s: float = 0.0  # per HTTP lookup on top of the index call; not measured here
    host: str = ""


@dataclass(frozen=True)
class ShardBudget:
    """What the plan may use of one Redis shard, and of one node for the cluster plane.

    Defaults: a shard is a 32 GiB Redis node with 24 GiB for data (room for the fork of a
    replication sync and fragmentation), half of its one main thread and half of a 10 Gbit/s
    NIC (peaks, failover), at least 3 masters (Redis Cluster's smallest sane size). A daemon
    is one Python interpreter (one GIL for everything it does): a quarter of a core for
    following the event stream and a quarter for HTTP cluster lookups, and 16 GiB of RAM for
    other nodes' chunks (the follower keeps their token ids).
    """

    memory_bytes: float = 24 * GiB
    cpu_headroom: float = 0.5
    nic_bytes_per_s: float = 1.25e9
    nic_headroom: float = 0.5
    min_shards: int = 3
    follower_cores: float = 0.25
    lookup_cores: float = 0.25
    node_memory_bytes: float = 16 * GiB

    def __post_init__(self) -> None:
        _positive(self, "memory_bytes", "nic_bytes_per_s", "follower_cores", "lookup_cores")
        _positive(self, "node_memory_bytes")
        _share(self, "cpu_headroom", "nic_headroom")
        _positive(self, "cpu_headroom", "nic_headroom")
        if self.min_shards < 1:
            raise SpecError("min_shards must be at least 1")


@dataclass(frozen=True)
class ScaleInputs:
    """The workload and the deployment.

    ``requests_per_node_s`` is per node. ``new_token_share``: the share of prompt tokens that
    miss (computed and stored as new chunks). ``store_output``: decode's KV is stored too (a
    conversation's next turn reuses it). ``copies_per_chunk``: (node, tier) copies per
    distinct chunk, cluster-wide (pulls, pushes and shared prefixes make more than one).
    ``namespaces``: distinct namespaces in use (model x tenant salt x LoRA); each is one slot.
    ``hot_namespace_share``: the share of chunks and lookups of the busiest namespace (None:
    an even spread, ``1 / namespaces``). ``namespaces_per_node``: namespaces each node
    publishes in (None: all of them). ``followers``: every node follows the event stream
    (``kv_events.remote``, on by default with the Redis index).
    ``updates_per_scattered_event``: chunk updates per event for demotions and removals. A
    request's new chunks are stored as one chain run (one event, ``OpCosts.events_per_chunk``),
    but demotions and evictions go chunk by chunk, leaves first (not in chain order), so each
    is an event of its own unless several fall into one 5 ms flush: 1.0, the conservative end.
    """

    nodes: int
    requests_per_node_s: float
    prompt_tokens: float
    new_token_share: float
    output_tokens: float
    kv_bytes_per_token: float
    dram_bytes_per_node: float
    ssd_bytes_per_node: float
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    copies_per_chunk: float = 1.0
    store_output: bool = True
    namespaces: int = 1
    hot_namespace_share: float | None = None
    namespaces_per_node: int | None = None
    lookups_per_request: float = 1.0  # the gateway asks one daemon once per request
    followers: bool = True
    heartbeat_s: float = 2.0  # ClusterConfig.heartbeat_s
    classes_refresh_s: float = 2.0  # cluster_link.NODE_CLASSES_CACHE_S
    max_events: int = 1_000_000  # RedisGlobalIndex(max_events=...)
    updates_per_scattered_event: float = 1.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.chunk_tokens < 1 or self.namespaces < 1 or self.max_events < 1:
            raise SpecError("nodes, chunk_tokens, namespaces and max_events must be >= 1")
        _positive(self, "kv_bytes_per_token", "heartbeat_s", "classes_refresh_s")
        _nonnegative(self, "requests_per_node_s", "prompt_tokens", "output_tokens")
        _nonnegative(self, "dram_bytes_per_node", "ssd_bytes_per_node", "lookups_per_request")
        _share(self, "new_token_share")
        if self.dram_bytes_per_node + self.ssd_bytes_per_node < self.chunk_bytes:
            raise SpecError("a node must hold at least one chunk (dram + ssd >= chunk bytes)")
        if self.copies_per_chunk < 1 or self.updates_per_scattered_event < 1:
            raise SpecError("copies_per_chunk and updates_per_scattered_event must be >= 1")
        if self.hot_namespace_share is not None and not (
            1 / self.namespaces <= self.hot_namespace_share <= 1
        ):
            raise SpecError("hot_namespace_share must be in [1 / namespaces, 1]")
        if self.namespaces_per_node is not None and not (
            1 <= self.namespaces_per_node <= self.namespaces
        ):
            raise SpecError("namespaces_per_node must be in [1, namespaces]")

    @property
    def chunk_bytes(self) -> float:
        return self.kv_bytes_per_token * self.chunk_tokens


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
class OpLoad:
    """One kind of Redis work: ``per_s`` operations a second on ``slot`` ("namespace": spread
    over the namespaces' slots; "registry" and "stream": one slot each), each costing
    ``server_s`` of a shard's main thread. A shard takes ``cpu_headroom / server_s`` of
    them a second (its ops budget for this kind)."""

    op: str
    slot: str
    per_s: float
    server_s: float

    @property
    def busy(self) -> float:
        """Main-thread seconds per second."""
        return self.per_s * self.server_s


@dataclass(frozen=True)
class ScalePlan:
    """What ``nodes`` nodes need of the Redis global index; see the module docstring."""

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


@dataclass(frozen=True)
class _Load:
    """Everything at one node count (the formulas' reasons are in :func:`_load`)."""

    owner_entries: float
    entries: float
    index_bytes: float
    live_bytes: float
    registry_bytes: float
    stream_bytes: float
    memory: float
    hot_memory: float
    new_chunks_s: float
    writes_s: float
    events_s: float
    lookups_s: float
    lookup_wall_s: float
    commands_s: float
    ops: tuple[OpLoad, ...]
    hot_busy: float
    registry_egress: float
    stream_egress: float
    hot_lookup_egress: float
    consumer_cpu: float  # per node
    consumer_memory: float  # per node
    daemon_lookup_cpu: float  # per node

    def busy(self, slot: str | None = None) -> float:
        return sum(o.busy for o in self.ops if slot is None or o.slot == slot)


def _load(inputs: ScaleInputs, costs: OpCosts) -> _Load:
    n = inputs.nodes
    chunk_bytes = inputs.chunk_bytes
    # Owner entries: every chunk a node's tiers hold is one 'node|epoch|tier' in an owners list.
    dram_chunks = math.floor(inputs.dram_bytes_per_node / chunk_bytes)
    ssd_chunks = math.floor(inputs.ssd_bytes_per_node / chunk_bytes)
    owner_entries = float(n * (dram_chunks + ssd_chunks))
    # Distinct chunks are the owners/meta hash fields; extra copies only lengthen a value.
    entries = owner_entries / inputs.copies_per_chunk
    index_bytes = (
        entries * costs.bytes_per_entry + (owner_entries - entries) * costs.bytes_per_extra_copy
    )
    per_node_ns = inputs.namespaces_per_node or inputs.namespaces
    # A namespace's live hash keeps one field per node that ever published in it.
    live_per_ns = min(float(n), n * per_node_ns / inputs.namespaces)
    live_bytes = n * per_node_ns * costs.bytes_per_live_field
    registry_bytes = n * costs.bytes_per_registered_node
    hot = inputs.hot_namespace_share or 1 / inputs.namespaces
    hot_memory = hot * index_bytes + live_per_ns * costs.bytes_per_live_field

    requests_s = n * inputs.requests_per_node_s
    new_tokens = inputs.prompt_tokens * inputs.new_token_share + (
        inputs.output_tokens if inputs.store_output else 0.0
    )
    new_chunks_s = requests_s * new_tokens / inputs.chunk_tokens
    # Steady state with full tiers: a new chunk is stored in DRAM, demoted (stored in SSD,
    # removed from DRAM), later evicted (removed from SSD): a store and a removal per tier.
    tiers = (dram_chunks > 0) + (ssd_chunks > 0)
    stored_s = removed_s = new_chunks_s * tiers
    writes_s = stored_s + removed_s
    # A request's new chunks are one chain run (one event); demotions and removals scatter.
    run_events_s = new_chunks_s * costs.events_per_chunk
    scattered = inputs.updates_per_scattered_event
    demotion_events_s = new_chunks_s * (tiers - 1) / scattered
    removal_events_s = removed_s / scattered
    events_s = run_events_s + demotion_events_s + removal_events_s
    # Stored events cost in proportion to their chunks (token ids are most of their bytes).
    per_stored_chunk = 1 / costs.run_chunks
    stream_bytes_s = (
        stored_s * costs.stream_bytes_per_stored_event * per_stored_chunk
        + removal_events_s * costs.stream_bytes_per_removed_event
    )
    # The stream keeps max_events entries of this mix (XADD MAXLEN ~ max_events).
    stream_bytes = inputs.max_events * stream_bytes_s / events_s if events_s else 0.0
    memory = index_bytes + live_bytes + registry_bytes + stream_bytes

    chain = inputs.prompt_tokens / inputs.chunk_tokens  # keys per lookup: the whole prompt
    lookups_s = requests_s * inputs.lookups_per_request
    # nodes(): the follower every heartbeat, and each daemon answering cluster lookups
    # re-reads the hardware classes at most every classes_refresh_s.
    listings_s = n * (
        (1 / inputs.heartbeat_s if inputs.followers else 0.0)
        + (1 / inputs.classes_refresh_s if lookups_s > 0 else 0.0)
    )
    followers = n if inputs.followers else 0
    ops = (
        OpLoad("lookup", "namespace", lookups_s, costs.lookup_server_s.at(chain, live_per_ns)),
        OpLoad("chunk stored", "namespace", stored_s, costs.store_server_s),
        OpLoad("chunk removed", "namespace", removed_s, costs.remove_server_s),
        # every node renews its lease in each namespace it published in, and the registry's
        OpLoad(
            "lease renewal (namespace)",
            "namespace",
            n / inputs.heartbeat_s * per_node_ns,
            costs.heartbeat_server_s,
        ),
        OpLoad(
            "lease renewal (registry)", "registry", n / inputs.heartbeat_s, costs.heartbeat_server_s
        ),
        # a listing reads every registered node's hash
        OpLoad("node listed", "registry", listings_s * n, costs.nodes_server_s_per_node),
        OpLoad("event appended", "stream", events_s, costs.xadd_server_s),
        # every follower reads every event: the stream's one slot serves n copies of each
        OpLoad(
            "stored chunk read by a follower",
            "stream",
            followers * stored_s,
            costs.stored_event_read_server_s * per_stored_chunk,
        ),
        OpLoad(
            "removal event read by a follower",
            "stream",
            followers * removal_events_s,
            costs.removed_event_read_server_s,
        ),
    )
    # The hot namespace's slot takes its share of lookups and writes and every renewal of
    # the nodes in its live hash; Redis Cluster never splits a slot.
    hot_busy = hot * sum(o.busy for o in ops[:3]) + (
        live_per_ns / inputs.heartbeat_s * costs.heartbeat_server_s
    )
    # A node flushes a batch at most every 5 ms (BatchingIndex's flush_interval).
    batches_s = n * min(200.0, writes_s / n)
    commands_s = (
        lookups_s * costs.commands_per_lookup
        + batches_s * costs.commands_per_publish_batch
        + n / inputs.heartbeat_s * (1 + per_node_ns)
        + listings_s * (1 + n)  # the live hash script, then one HGETALL per node
    )
    stream_egress = followers * (
        stored_s * costs.stored_event_read_bytes * per_stored_chunk
        + removal_events_s * costs.removed_event_read_bytes
    )
    # A follower applies every other node's chunk updates and keeps their token ids.
    consumer_cpu = (
        stored_s * costs.consumer_cpu_s_per_stored + removed_s * costs.consumer_cpu_s_per_removed
        if inputs.followers
        else 0.0
    )
    consumer_memory = entries * costs.remote_inventory_bytes_per_chunk if inputs.followers else 0.0
    # A daemon answers its share of cluster lookups (HMGET + the live hash parsed in Python)
    # and re-lists the nodes for their hardware classes.
    daemon_lookup_cpu = inputs.requests_per_node_s * inputs.lookups_per_request * (
        costs.lookup_client_cpu_s.at(chain, live_per_ns) + costs.http_overhead_s
    ) + (n * costs.nodes_client_cpu_s_per_node / inputs.classes_refresh_s if lookups_s else 0.0)
    return _Load(
        owner_entries=owner_entries,
        entries=entries,
        index_bytes=index_bytes,
        live_bytes=live_bytes,
        registry_bytes=registry_bytes,
        stream_bytes=stream_bytes,
        memory=memory,
        hot_memory=hot_memory,
        new_chunks_s=new_chunks_s,
        writes_s=writes_s,
        events_s=events_s,
        lookups_s=lookups_s,
        lookup_wall_s=costs.lookup_client_wall_s.at(chain, live_per_ns),
        commands_s=commands_s,
        ops=ops,
        hot_busy=hot_busy,
        registry_egress=listings_s * n * costs.nodes_reply_bytes_per_node,
        stream_egress=stream_egress,
        hot_lookup_egress=hot * lookups_s * costs.lookup_reply_bytes.at(chain, live_per_ns),
        consumer_cpu=consumer_cpu,
        consumer_memory=consumer_memory,
        daemon_lookup_cpu=daemon_lookup_cpu,
    )


Usage = tuple[str, float]  # (resource, utilization)
Meter = Callable[[_Load], Usage]


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
        return meter(_load(replace(inputs, nodes=n), costs))[1] >= 1.0

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
    """The plan for ``inputs.nodes`` nodes; see the module docstring for the model.

    Shards: by memory, the whole index over the per-shard memory budget; by ops, the
    main-thread seconds per second of every operation over the per-shard CPU headroom; the
    larger (at least ``min_shards``) is the plan. Single-slot components (the hot namespace,
    the registry, the stream) and per-node ones are checked on their own: no shard count
    helps them, so they say the plan is not feasible (:attr:`ScalePlan.blocked_by`).
    """
    budget = shard_budget or ShardBudget()
    load = _load(inputs, costs)
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


REFERENCE_10K = ScaleInputs(
    nodes=10_000,
    requests_per_node_s=2.0,
    prompt_tokens=4096,
    new_token_share=0.5,
    output_tokens=256,
    kv_bytes_per_token=kv_bytes_per_token(32, 8, 128, 2),  # Llama-3.1-8B, bf16: 128 KiB
    dram_bytes_per_node=256 * GiB,
    ssd_bytes_per_node=2 * TiB,
    copies_per_chunk=2.0,
)
"""The workload of ``plan_10k_redis_shards`` (docs/capacity-plan-10k.md): one model (one
namespace), 2 requests/s per node of 4k-token prompts, half of them new, 256 output tokens
stored, 256 GiB of DRAM and 2 TiB of SSD of KV per node, two copies of each chunk."""
