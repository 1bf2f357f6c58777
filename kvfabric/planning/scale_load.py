"""The load N nodes put on the Redis global index: entries, bytes, rates, Redis work.

Who calls: :mod:`kvfabric.planning.scale`, with :func:`load_at` at the plan's node count and,
searching for where each component saturates, at others. Pure arithmetic: no I/O, no
clock; the same :class:`~kvfabric.planning.scale_inputs.ScaleInputs` and
:class:`~kvfabric.planning.scale_inputs.OpCosts` always give the same :class:`Load`. Units as
in :mod:`kvfabric.planning.scale_inputs` (bytes, seconds, per-second rates); the per-node
figures of :class:`Load` say so. Nothing here raises: the inputs were checked when built.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfabric.planning.scale_inputs import OpCosts, ScaleInputs


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
class Load:
    """Everything at one node count (the formulas' reasons are in :func:`load_at`)."""

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


def load_at(inputs: ScaleInputs, costs: OpCosts) -> Load:
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
    return Load(
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
