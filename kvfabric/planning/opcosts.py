"""Measure :class:`~kvfabric.planning.scale_inputs.OpCosts` on a real Redis server.

Who calls: whoever plans a cluster (``docs/capacity-plan-10k.md``, later ``kvfabric plan
scale``) and the integration test. The caller starts a ``redis-server`` (one server, not a
cluster: the costs are one shard's) and passes its ``redis://`` URL; nothing here starts or
stops a process. The keys go under a fresh prefix and are deleted at the end, so a shared
server keeps its data, but the server's CPU and network counters are read as deltas: other
clients' traffic during the run inflates the result (use a server of your own).

What is timed is kvfabric's own code against that server, in this order:

1. ``live_nodes`` nodes register (:meth:`RedisGlobalIndex.register`) and publish one chunk
   each into one namespace, so its live hash has that many fields (a lookup reads it whole);
2. a writer publishes ``chains`` chains of ``chain_chunks`` chunks with their token ids, one
   run of ``run_chunks`` chunks per flush (one request's new chunks per batch); a second node
   publishes the same chunks (the cost of a second copy); a second namespace gets a few
   chains from both (a live hash of 2 nodes);
3. :meth:`RedisGlobalIndex.lookup` of whole chains and of one chunk in the crowded
   namespace, and of whole chains in the small one: three points that give the lookup's
   cost per chunk and per live node;
4. :meth:`RedisGlobalIndex.nodes` and :meth:`RedisGlobalIndex.heartbeat`;
5. the event path of a node that follows the stream: ``IndexRemoteSource.read`` (XREAD,
   :func:`kvfabric.cluster.events.decode`), ``RemoteInventory.apply`` and the vLLM wire
   encoding of what it announces; :func:`~kvfabric.cluster.events.encode` /
   :func:`~kvfabric.cluster.events.decode` alone;
6. the second node removes its copies of a quarter of the chains, one chunk per batch
   (evictions and demotions come chunk by chunk): the cost of a removal and of a removal
   event, and the follower's cost to read and apply them.

How each figure is read off the server and the host, and in which units, is
:mod:`kvfabric.planning.opcosts_counters`'s; the traffic published is
:mod:`kvfabric.planning.opcosts_workload`'s, the event path's costs (steps 5 and 6)
:mod:`kvfabric.planning.opcosts_events`'s. The XADD cost is ``INFO commandstats``'s
execution time (the rest of a publish batch's CPU goes to the namespace's update script).

Duration: a few seconds with the defaults. Errors: :class:`~kvfabric.errors.SpecError` for
a ``redis+cluster://`` URL or bad sizes; :class:`~kvfabric.errors.UnavailableError` when
the server cannot be reached; ``RuntimeError`` if the index does not answer what was just
published (another client deleting the prefix's keys, or a bug).
"""

from __future__ import annotations

import os
import platform
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis

from kvfabric.cluster.index import ChunkRecord, NodeInfo
from kvfabric.cluster.redis_index import CLUSTER_SCHEME, RedisGlobalIndex
from kvfabric.errors import SpecError, UnavailableError
from kvfabric.planning.opcosts_counters import (
    PerOp,
    ServerCounters,
    fit_linear,
    info,
    interleaved,
    memory_usage,
    per,
    per_op,
    thirds,
)
from kvfabric.planning.opcosts_events import codec_costs, follow, inventory_bytes
from kvfabric.planning.opcosts_workload import TIER, make_chains, node_id, publish_runs
from kvfabric.planning.scale_inputs import LinearCost, OpCosts
from kvfabric.server.remote_chunks import IndexRemoteSource
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, KVSpec, Namespace

# the top-level commands of the index's publish path (scripts run their inner commands,
# which the server counts too: those are left out)
PUBLISH_COMMANDS = ("evalsha", "eval", "xadd", "sadd")
LOOKUP_COMMANDS = ("evalsha", "eval")
LOOKUP_ROUNDS = 5  # parts per lookup point, interleaved; the least per-op cost is kept
LookupPart = list[Callable[[], int]]


def measure_opcosts(
    url: str,
    *,
    live_nodes: int = 200,
    chains: int = 40,
    chain_chunks: int = 32,
    run_chunks: int = 8,
    lookups: int = 600,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    node_id_chars: int = 24,
    http_overhead_s: float = 0.0,
    host: str = "",
) -> OpCosts:
    """Measure every :class:`OpCosts` field against the redis-server at ``url`` (see the
    module docstring). ``host`` names the machine in the result (with its architecture and
    CPU count, and the server's version); ``http_overhead_s`` (a daemon's HTTP handling per
    lookup, from ``benchmarks/daemon_bench.py``) is passed through, not measured."""
    scheme, sep, _ = url.partition("://")
    if sep and scheme.lower() == CLUSTER_SCHEME:
        raise SpecError("measure one Redis server (redis://), not a cluster: costs are a shard's")
    if live_nodes < 130:  # past hash-max-listpack-entries: hashes as large clusters have them
        raise SpecError("live_nodes must be >= 130")
    if not (chains >= 4 and chain_chunks >= 2 and run_chunks >= 1 and lookups >= 10):
        raise SpecError("need chains >= 4, chain_chunks >= 2, run_chunks >= 1, lookups >= 10")
    if chain_chunks % run_chunks:
        raise SpecError("chain_chunks must be a multiple of run_chunks (runs within a chain)")
    if node_id_chars < 12 or node_id_chars > 128:
        raise SpecError("node_id_chars must be in [12, 128]")
    try:
        raw = redis.Redis.from_url(url, socket_timeout=10.0, socket_connect_timeout=5.0)
        raw.ping()
    except redis.exceptions.RedisError as exc:
        raise UnavailableError(f"Redis at {url} unavailable: {exc}") from None
    prefix = f"kvf-opcosts-{secrets.token_hex(4)}"
    opened: list[RedisGlobalIndex] = []

    def index() -> RedisGlobalIndex:
        opened.append(
            RedisGlobalIndex(
                url, prefix=prefix, lease_ttl=300.0, socket_timeout=5.0, flush_interval=0.001
            )
        )
        return opened[-1]

    try:
        return _measure(
            raw,
            index,
            prefix,
            live_nodes=live_nodes,
            chains=chains,
            chain_chunks=chain_chunks,
            run_chunks=run_chunks,
            lookups=lookups,
            chunk_tokens=chunk_tokens,
            node_id_chars=node_id_chars,
            http_overhead_s=http_overhead_s,
            host=host,
        )
    except redis.exceptions.RedisError as exc:
        raise UnavailableError(f"Redis at {url} failed during the measurement: {exc}") from None
    finally:
        for opened_index in opened:
            opened_index.close()
        try:
            names = list(raw.scan_iter(match=f"{prefix}:*", count=1000))
            for i in range(0, len(names), 500):
                raw.unlink(*names[i : i + 500])
        except redis.exceptions.RedisError:
            pass  # the measurement's error (if any) says more; the keys are under a prefix
        raw.close()


def _measure(
    raw: redis.Redis,
    index: Callable[[], RedisGlobalIndex],
    prefix: str,
    *,
    live_nodes: int,
    chains: int,
    chain_chunks: int,
    run_chunks: int,
    lookups: int,
    chunk_tokens: int,
    node_id_chars: int,
    http_overhead_s: float,
    host: str,
) -> OpCosts:
    server = ServerCounters(raw)
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=chunk_tokens)
    big, small = Namespace("opcosts-big", spec), Namespace("opcosts-small", spec)
    big_chains = make_chains(big, chains, chain_chunks, seed=1)
    small_chains = make_chains(small, chains // 4, chain_chunks, seed=2)
    crowd_chunks = [c[0] for c in make_chains(big, live_nodes, 1, seed=3)]

    def ns_key(ns: Namespace, what: str) -> str:
        return f"{prefix}:{{{ns.seed.hex()}}}:{what}"

    stream = f"{prefix}:{{events}}:stream"

    def stream_len() -> int:
        return int(raw.xlen(stream))

    # 1. the crowd: registered nodes that published into the big namespace
    crowd = index()
    crowd_ids = [node_id("crowd", i, node_id_chars) for i in range(live_nodes)]
    register_wall = 0.0
    for i, (node, record) in enumerate(zip(crowd_ids, crowd_chunks, strict=True)):
        start = time.perf_counter()
        crowd.register(NodeInfo(node, f"10.0.{i // 250}.{i % 250}:7000", (TIER,)))
        register_wall += time.perf_counter() - start
        crowd.publish(stored=[record])
        crowd.flush(timeout=30.0)

    # 2. the writer's chains (measured), then a second copy of them (measured)
    writer, copy = index(), index()
    writer_id = node_id("writer", 0, node_id_chars)
    writer.register(NodeInfo(writer_id, "10.1.0.1:7000", (TIER,)))
    copy.register(NodeInfo(node_id("copy", 0, node_id_chars), "10.1.0.2:7000", (TIER,)))
    chunks = chains * chain_chunks
    owners_meta = (ns_key(big, "owners"), ns_key(big, "meta"))
    last = cast(list[Any], raw.xrevrange(stream, count=1))
    stream_mark = last[0][0].decode() if last else "0-0"
    memory0, stream_memory0, events0 = (
        memory_usage(raw, *owners_meta),
        memory_usage(raw, stream),
        stream_len(),
    )

    def store(part: Sequence[list[ChunkRecord]]) -> Callable[[], int]:
        return lambda: publish_runs(writer, part, run_chunks, removed=False) * run_chunks

    stored = per_op(server, [store(part) for part in thirds(big_chains)])
    memory1, stream_memory1, events1 = (
        memory_usage(raw, *owners_meta),
        memory_usage(raw, stream),
        stream_len(),
    )
    publish_runs(copy, big_chains, run_chunks, removed=False)
    memory2 = memory_usage(raw, *owners_meta)
    for publisher in (writer, copy):
        publish_runs(publisher, small_chains, run_chunks, removed=False)
    stored_events = events1 - events0
    xadd_s = stored.usec_per_call("xadd")

    # 3. lookups at three points
    live_big, live_small = int(raw.hlen(ns_key(big, "live"))), int(raw.hlen(ns_key(small, "live")))

    def lookup_part(ns: Namespace, chain_set: list[list[ChunkRecord]], length: int) -> LookupPart:
        keys = [[r.key for r in chain[:length]] for chain in chain_set]
        for chain_keys in keys:  # warm: scripts loaded, connections open
            if writer.lookup(ns.seed, chain_keys).matched_chunks != length:
                raise RuntimeError("the index does not answer the chains just published")

        def part() -> int:
            count = max(1, lookups // LOOKUP_ROUNDS)
            for i in range(count):
                writer.lookup(ns.seed, keys[i % len(keys)])
            return count

        return [part] * LOOKUP_ROUNDS

    points = interleaved(
        server,
        {
            "full": lookup_part(big, big_chains, chain_chunks),
            "one": lookup_part(big, big_chains, 1),
            "few": lookup_part(small, small_chains, chain_chunks),
        },
        LOOKUP_ROUNDS,
    )
    full, one, few = points["full"], points["one"], points["few"]

    def fit(metric: Callable[[PerOp], float]) -> LinearCost:
        return fit_linear(
            metric(full), metric(one), metric(few), chain_chunks, live_big, live_small
        )

    # 4. nodes() and heartbeats
    listed = len(writer.nodes())

    def listing() -> int:
        for _ in range(4):
            writer.nodes()
        return 4 * listed

    nodes = per_op(server, [listing] * 3)
    scripts_per_beat = 1 + 2  # the registry and the writer's two namespaces

    def beat() -> int:
        for _ in range(70):
            writer.heartbeat()
        return 70 * scripts_per_beat

    beats = per_op(server, [beat] * 3)

    # 5. the event path: a follower reads what the writer and the copy stored, ...
    source = IndexRemoteSource(index())
    stored_events_read = stream_len() - events0
    stored_read, stored_apply_cpu, stored_updates, stored_end = follow(
        server, source, stream_mark, stored_events_read, []
    )
    remote_bytes = inventory_bytes(stored_updates)
    encode_s, decode_s = codec_costs(big_chains, run_chunks, writer_id)

    # 6. ... and what the copy then removes, chunk by chunk (evictions and demotions come
    # one at a time, leaves first: single-chunk events)
    removals = [[rec] for chain in big_chains[: max(3, chains // 4)] for rec in chain]
    stream_memory2, events2 = memory_usage(raw, stream), stream_len()

    def remove(part: Sequence[list[ChunkRecord]]) -> Callable[[], int]:
        return lambda: publish_runs(copy, part, 1, removed=True)

    removed = per_op(server, [remove(part) for part in thirds(removals)])
    removed_events = stream_len() - events2
    removed_read, removed_apply_cpu, removed_updates, _ = follow(
        server, source, stored_end, removed_events, stored_updates
    )

    registry = [
        f"{prefix}:{{reg}}:{what}:{node}"
        for node in crowd_ids
        for what in ("node", "epoch", "seeds")
    ]
    reg_live = f"{prefix}:{{reg}}:live"
    version = str(info(raw, "server").get("redis_version", "?"))
    where = f"{platform.machine()}, {os.cpu_count()} CPUs, redis {version}"
    return OpCosts(
        commands_per_lookup=per(full.count(LOOKUP_COMMANDS), full.ops),
        commands_per_publish_batch=per(stored.count(PUBLISH_COMMANDS), stored.ops / run_chunks),
        lookup_server_s=fit(lambda t: t.server_cpu),
        # a batch's CPU less its XADDs' execution is its update script's (and its I/O)
        store_server_s=max(0.0, stored.server_cpu - xadd_s * stored_events / chunks),
        remove_server_s=max(
            0.0, removed.server_cpu - removed.usec_per_call("xadd") * removed_events / removed.ops
        ),
        xadd_server_s=xadd_s,
        stored_event_read_server_s=stored_read.server_cpu,
        removed_event_read_server_s=removed_read.server_cpu,
        heartbeat_server_s=beats.server_cpu,
        nodes_server_s_per_node=nodes.server_cpu,
        bytes_per_entry=per(memory1 - memory0, chunks),
        bytes_per_extra_copy=per(memory2 - memory1, chunks),
        bytes_per_live_field=per(memory_usage(raw, ns_key(big, "live")), live_big),
        bytes_per_registered_node=per(memory_usage(raw, *registry), live_nodes)
        + per(memory_usage(raw, reg_live), int(raw.hlen(reg_live))),
        stream_bytes_per_stored_event=per(stream_memory1 - stream_memory0, stored_events),
        stream_bytes_per_removed_event=per(
            memory_usage(raw, stream) - stream_memory2, removed_events
        ),
        lookup_reply_bytes=fit(lambda t: t.net_out),
        stored_event_read_bytes=stored_read.net_out,
        removed_event_read_bytes=removed_read.net_out,
        nodes_reply_bytes_per_node=nodes.net_out,
        events_per_chunk=per(stored_events, chunks),
        event_encode_s=encode_s,
        event_decode_s=decode_s,
        consumer_cpu_s_per_stored=per(
            stored_read.cpu * stored_events_read + stored_apply_cpu, len(stored_updates)
        ),
        consumer_cpu_s_per_removed=per(
            removed_read.cpu * removed_events + removed_apply_cpu, len(removed_updates)
        ),
        remote_inventory_bytes_per_chunk=remote_bytes,
        lookup_client_cpu_s=fit(lambda t: t.cpu),
        lookup_client_wall_s=fit(lambda t: t.wall),
        nodes_client_cpu_s_per_node=nodes.cpu,
        register_client_s=per(register_wall, live_nodes),
        chunk_tokens=chunk_tokens,
        node_id_chars=node_id_chars,
        run_chunks=run_chunks,
        http_overhead_s=http_overhead_s,
        host=f"{host}; {where}" if host else where,
    )
