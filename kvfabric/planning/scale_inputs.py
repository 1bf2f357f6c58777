"""The inputs of a scale plan: the workload, the measured per-operation costs, the budgets.

Who calls: :mod:`kvfabric.planning.scale` (the plan takes a :class:`ScaleInputs`, an
:class:`OpCosts` and a :class:`ShardBudget`), :mod:`kvfabric.planning.opcosts` (which measures
an :class:`OpCosts` on one Redis server), ``kvfabric plan scale`` and the benchmarks (both
start from :data:`REFERENCE_10K`), and ``docs/capacity-plan-10k.md``. Plain frozen values: no
I/O, no clock.

Units: bytes, seconds, per-second rates; request rates are **per node** (the cluster's rate is
``nodes * requests_per_node_s``); node and shard counts are ints. Bad inputs (negative
rates, shares outside [0, 1], no capacity at all) raise :class:`~kvfabric.errors.SpecError`
when the value is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfabric.errors import SpecError
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, KVSpec

GiB = 1 << 30
TiB = 1 << 40


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
