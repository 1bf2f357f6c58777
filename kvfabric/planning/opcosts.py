"""Measure :class:`~kvfabric.planning.scale.OpCosts` on a real Redis server.

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

Each cost is the least per operation over several parts (lookups: interleaved rounds): a
shared or virtual host's steal and neighbours only ever add to a measurement.

Units as in :class:`OpCosts`: Redis main-thread CPU seconds from ``INFO cpu``, the calling
thread's CPU seconds from ``time.thread_time``, wall seconds from ``time.perf_counter``,
memory from ``MEMORY USAGE ... SAMPLES 0``, network from ``INFO stats`` byte counters (the
``INFO`` calls' own replies are calibrated out). The XADD cost is ``INFO commandstats``'s
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
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import redis

from kvfabric.cluster import events as codec
from kvfabric.cluster.index import ChunkRecord, KVEvent, NodeInfo, Update
from kvfabric.cluster.redis_index import CLUSTER_SCHEME, RedisGlobalIndex
from kvfabric.errors import SpecError, UnavailableError
from kvfabric.hashing import chunk_hashes
from kvfabric.kvevents.remote import RemoteInventory, RemoteUpdate
from kvfabric.kvevents.wire import encode_batch
from kvfabric.planning.scale import LinearCost, OpCosts
from kvfabric.server.remote_chunks import IndexRemoteSource
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, KVSpec, Namespace

TIER = "dram"
BLOCK_SIZE = 16  # vLLM's default block size: what a follower names chunks as
# the top-level commands of the index's publish path (scripts run their inner commands,
# which the server counts too: those are left out)
PUBLISH_COMMANDS = ("evalsha", "eval", "xadd", "sadd")
LOOKUP_COMMANDS = ("evalsha", "eval")
T = TypeVar("T")
LOOKUP_ROUNDS = 5  # parts per lookup point, interleaved; the least per-op cost is kept
LookupPart = list[Callable[[], int]]


@dataclass(frozen=True)
class _Reading:
    cpu: float  # main-thread CPU seconds
    net_in: int
    net_out: int
    calls: dict[str, int]
    usec: dict[str, int]


@dataclass(frozen=True)
class _Delta:
    cpu: float
    net_in: float
    net_out: float
    calls: dict[str, int]
    usec: dict[str, int]


class _Server:
    """The server's counters, read as deltas with the cost of reading them taken out."""

    def __init__(self, client: redis.Redis) -> None:
        self._r = client
        self._overhead = _Delta(0.0, 0.0, 0.0, {}, {})
        first = self._read()
        pairs = []
        for _ in range(5):  # two reads back to back: what one read itself costs
            second = self._read()
            pairs.append(self._diff(first, second))
            first = second
        self._overhead = _Delta(
            min(p.cpu for p in pairs),
            min(p.net_in for p in pairs),
            min(p.net_out for p in pairs),
            {},
            {},
        )

    def _read(self) -> _Reading:
        cpu = _info(self._r, "cpu")
        stats = _info(self._r, "stats")
        commands = _info(self._r, "commandstats")
        return _Reading(
            float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"]),
            int(stats["total_net_input_bytes"]),
            int(stats["total_net_output_bytes"]),
            {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in commands.items()},
            {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in commands.items()},
        )

    def _diff(self, a: _Reading, b: _Reading) -> _Delta:
        o = self._overhead
        return _Delta(
            max(0.0, b.cpu - a.cpu - o.cpu),
            max(0.0, b.net_in - a.net_in - o.net_in),
            max(0.0, b.net_out - a.net_out - o.net_out),
            {k: v - a.calls.get(k, 0) for k, v in b.calls.items()},
            {k: v - a.usec.get(k, 0) for k, v in b.usec.items()},
        )

    @contextmanager
    def measure(self, out: list[_Delta]) -> Iterator[None]:
        """Append the counters' delta over the block to ``out``."""
        before = self._read()
        yield
        out.append(self._diff(before, self._read()))


@dataclass(frozen=True)
class _PerOp:
    """One operation's cost: per-op figures are the smallest over the parts it was measured
    in (a shared VM's steal and neighbours only ever add), command counts are totals."""

    ops: int
    server_cpu: float  # Redis main-thread seconds
    cpu: float  # calling thread
    wall: float
    net_out: float
    calls: dict[str, int]
    usec: dict[str, int]

    def count(self, names: Sequence[str]) -> int:
        return sum(self.calls.get(n, 0) for n in names)

    def usec_per_call(self, name: str) -> float:
        return _per(self.usec.get(name, 0) * 1e-6, self.calls.get(name, 0))


def _per_op(server: _Server, parts: Sequence[Callable[[], int]]) -> _PerOp:
    """Run each part (it returns how many operations it did) under the counters."""
    return _interleaved(server, {"": parts}, len(parts))[""]


def _interleaved(
    server: _Server, parts: dict[str, Sequence[Callable[[], int]]], rounds: int
) -> dict[str, _PerOp]:
    """Round by round, one part of every operation in turn, so that a noisy spell of the
    host spoils one part of each rather than every part of one."""
    rows: dict[str, list[tuple[int, _Delta, float, float]]] = {name: [] for name in parts}
    for i in range(rounds):
        for name, fns in parts.items():
            if i >= len(fns):
                continue
            deltas: list[_Delta] = []
            with server.measure(deltas):
                cpu, wall = time.thread_time(), time.perf_counter()
                ops = fns[i]()
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            rows[name].append((ops, deltas[0], cpu, wall))
    return {name: _summary(r) for name, r in rows.items()}


def _summary(rows: list[tuple[int, _Delta, float, float]]) -> _PerOp:
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for _, delta, _, _ in rows:
        for name, n in delta.calls.items():
            calls[name] = calls.get(name, 0) + n
        for name, n in delta.usec.items():
            usec[name] = usec.get(name, 0) + n
    done = [row for row in rows if row[0]]
    return _PerOp(
        sum(row[0] for row in rows),
        min((d.cpu / n for n, d, _, _ in done), default=0.0),
        min((c / n for n, _, c, _ in done), default=0.0),
        min((w / n for n, _, _, w in done), default=0.0),
        min((d.net_out / n for n, d, _, _ in done), default=0.0),
        calls,
        usec,
    )


def _thirds(items: Sequence[T]) -> list[Sequence[T]]:
    """Three parts (fewer when there are fewer items)."""
    step = max(1, -(-len(items) // 3))
    return [items[i : i + step] for i in range(0, len(items), step)]


def _info(client: redis.Redis, section: str) -> dict[str, Any]:
    reply: dict[str, Any] = client.info(section)
    return reply


def _memory(client: redis.Redis, *keys: str) -> int:
    total = 0
    for key in keys:
        used = client.memory_usage(key, samples=0)
        total += int(used or 0)
    return total


def _node_id(tag: str, i: int, chars: int) -> str:
    """A node id of exactly ``chars`` characters (ids' length is part of every owner entry,
    live field and event)."""
    return f"{tag}-{i:0{chars - len(tag) - 1}d}"


def _chains(ns: Namespace, count: int, chain_chunks: int, seed: int) -> list[list[ChunkRecord]]:
    """``count`` chains of full chunks with their token ids, as a node publishes them."""
    ct = ns.spec.chunk_tokens
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, 128_000, size=chain_chunks * ct, dtype="<i4")
        refs = chunk_hashes(ns, tokens)
        out.append(
            [
                ChunkRecord(
                    ns.seed,
                    ref.key,
                    TIER,
                    ref.parent,
                    ref.num_tokens,
                    tokens[i * ct : (i + 1) * ct].tobytes(),
                    ct,
                )
                for i, ref in enumerate(refs)
            ]
        )
    return out


def _publish_runs(
    index: RedisGlobalIndex,
    chains: Sequence[list[ChunkRecord]],
    run_chunks: int,
    *,
    removed: bool,
) -> int:
    """Publish every chain, one run of ``run_chunks`` per flush (one batch); the batches."""
    batches = 0
    for chain in chains:
        for i in range(0, len(chain), run_chunks):
            run = chain[i : i + run_chunks]
            if removed:
                index.publish(removed=run)
            else:
                index.publish(stored=run)
            index.flush(timeout=30.0)
            batches += 1
    return batches


def _per(value: float, count: float) -> float:
    return value / count if count else 0.0


def _fit(
    full: float, one: float, small: float, chunks: int, live_big: int, live_small: int
) -> LinearCost:
    """base + per_chunk * chunks + per_live * live from three points: (chunks, live_big),
    (1, live_big), (chunks, live_small); noise never makes a term negative."""
    per_chunk = max(0.0, (full - one) / (chunks - 1))
    per_live = max(0.0, (full - small) / (live_big - live_small))
    base = max(0.0, small - per_chunk * chunks - per_live * live_small)
    return LinearCost(base, per_chunk, per_live)


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
    server = _Server(raw)
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=chunk_tokens)
    big, small = Namespace("opcosts-big", spec), Namespace("opcosts-small", spec)
    big_chains = _chains(big, chains, chain_chunks, seed=1)
    small_chains = _chains(small, chains // 4, chain_chunks, seed=2)
    crowd_chunks = [c[0] for c in _chains(big, live_nodes, 1, seed=3)]

    def ns_key(ns: Namespace, what: str) -> str:
        return f"{prefix}:{{{ns.seed.hex()}}}:{what}"

    stream = f"{prefix}:{{events}}:stream"

    def stream_len() -> int:
        return int(raw.xlen(stream))

    # 1. the crowd: registered nodes that published into the big namespace
    crowd = index()
    crowd_ids = [_node_id("crowd", i, node_id_chars) for i in range(live_nodes)]
    register_wall = 0.0
    for i, (node, record) in enumerate(zip(crowd_ids, crowd_chunks, strict=True)):
        start = time.perf_counter()
        crowd.register(NodeInfo(node, f"10.0.{i // 250}.{i % 250}:7000", (TIER,)))
        register_wall += time.perf_counter() - start
        crowd.publish(stored=[record])
        crowd.flush(timeout=30.0)

    # 2. the writer's chains (measured), then a second copy of them (measured)
    writer, copy = index(), index()
    writer_id = _node_id("writer", 0, node_id_chars)
    writer.register(NodeInfo(writer_id, "10.1.0.1:7000", (TIER,)))
    copy.register(NodeInfo(_node_id("copy", 0, node_id_chars), "10.1.0.2:7000", (TIER,)))
    chunks = chains * chain_chunks
    owners_meta = (ns_key(big, "owners"), ns_key(big, "meta"))
    last = cast(list[Any], raw.xrevrange(stream, count=1))
    stream_mark = last[0][0].decode() if last else "0-0"
    memory0, stream_memory0, events0 = (
        _memory(raw, *owners_meta),
        _memory(raw, stream),
        stream_len(),
    )

    def store(part: Sequence[list[ChunkRecord]]) -> Callable[[], int]:
        return lambda: _publish_runs(writer, part, run_chunks, removed=False) * run_chunks

    stored = _per_op(server, [store(part) for part in _thirds(big_chains)])
    memory1, stream_memory1, events1 = (
        _memory(raw, *owners_meta),
        _memory(raw, stream),
        stream_len(),
    )
    _publish_runs(copy, big_chains, run_chunks, removed=False)
    memory2 = _memory(raw, *owners_meta)
    for publisher in (writer, copy):
        _publish_runs(publisher, small_chains, run_chunks, removed=False)
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

    points = _interleaved(
        server,
        {
            "full": lookup_part(big, big_chains, chain_chunks),
            "one": lookup_part(big, big_chains, 1),
            "few": lookup_part(small, small_chains, chain_chunks),
        },
        LOOKUP_ROUNDS,
    )
    full, one, few = points["full"], points["one"], points["few"]

    def fit(metric: Callable[[_PerOp], float]) -> LinearCost:
        return _fit(metric(full), metric(one), metric(few), chain_chunks, live_big, live_small)

    # 4. nodes() and heartbeats
    listed = len(writer.nodes())

    def listing() -> int:
        for _ in range(4):
            writer.nodes()
        return 4 * listed

    nodes = _per_op(server, [listing] * 3)
    scripts_per_beat = 1 + 2  # the registry and the writer's two namespaces

    def beat() -> int:
        for _ in range(70):
            writer.heartbeat()
        return 70 * scripts_per_beat

    beats = _per_op(server, [beat] * 3)

    # 5. the event path: a follower reads what the writer and the copy stored, ...
    source = IndexRemoteSource(index())
    stored_events_read = stream_len() - events0
    stored_read, stored_apply_cpu, stored_updates, stored_end = _follow(
        server, source, stream_mark, stored_events_read, []
    )
    remote_bytes = _inventory_bytes(stored_updates)
    encode_s, decode_s = _codec_costs(big_chains, run_chunks, writer_id)

    # 6. ... and what the copy then removes, chunk by chunk (evictions and demotions come
    # one at a time, leaves first: single-chunk events)
    removals = [[rec] for chain in big_chains[: max(3, chains // 4)] for rec in chain]
    stream_memory2, events2 = _memory(raw, stream), stream_len()

    def remove(part: Sequence[list[ChunkRecord]]) -> Callable[[], int]:
        return lambda: _publish_runs(copy, part, 1, removed=True)

    removed = _per_op(server, [remove(part) for part in _thirds(removals)])
    removed_events = stream_len() - events2
    removed_read, removed_apply_cpu, removed_updates, _ = _follow(
        server, source, stored_end, removed_events, stored_updates
    )

    registry = [
        f"{prefix}:{{reg}}:{what}:{node}"
        for node in crowd_ids
        for what in ("node", "epoch", "seeds")
    ]
    reg_live = f"{prefix}:{{reg}}:live"
    version = str(_info(raw, "server").get("redis_version", "?"))
    where = f"{platform.machine()}, {os.cpu_count()} CPUs, redis {version}"
    return OpCosts(
        commands_per_lookup=_per(full.count(LOOKUP_COMMANDS), full.ops),
        commands_per_publish_batch=_per(stored.count(PUBLISH_COMMANDS), stored.ops / run_chunks),
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
        bytes_per_entry=_per(memory1 - memory0, chunks),
        bytes_per_extra_copy=_per(memory2 - memory1, chunks),
        bytes_per_live_field=_per(_memory(raw, ns_key(big, "live")), live_big),
        bytes_per_registered_node=_per(_memory(raw, *registry), live_nodes)
        + _per(_memory(raw, reg_live), int(raw.hlen(reg_live))),
        stream_bytes_per_stored_event=_per(stream_memory1 - stream_memory0, stored_events),
        stream_bytes_per_removed_event=_per(_memory(raw, stream) - stream_memory2, removed_events),
        lookup_reply_bytes=fit(lambda t: t.net_out),
        stored_event_read_bytes=stored_read.net_out,
        removed_event_read_bytes=removed_read.net_out,
        nodes_reply_bytes_per_node=nodes.net_out,
        events_per_chunk=_per(stored_events, chunks),
        event_encode_s=encode_s,
        event_decode_s=decode_s,
        consumer_cpu_s_per_stored=_per(
            stored_read.cpu * stored_events_read + stored_apply_cpu, len(stored_updates)
        ),
        consumer_cpu_s_per_removed=_per(
            removed_read.cpu * removed_events + removed_apply_cpu, len(removed_updates)
        ),
        remote_inventory_bytes_per_chunk=remote_bytes,
        lookup_client_cpu_s=fit(lambda t: t.cpu),
        lookup_client_wall_s=fit(lambda t: t.wall),
        nodes_client_cpu_s_per_node=nodes.cpu,
        register_client_s=_per(register_wall, live_nodes),
        chunk_tokens=chunk_tokens,
        node_id_chars=node_id_chars,
        run_chunks=run_chunks,
        http_overhead_s=http_overhead_s,
        host=f"{host}; {where}" if host else where,
    )


class _Follow:
    """What a node's kv_events follower does with the index's stream (the daemon's
    :class:`RemoteFollower` loop, minus the thread): read from a position until caught up,
    then apply the updates and encode the vLLM events it announces."""

    def __init__(
        self, source: IndexRemoteSource, inventory: RemoteInventory, position: str
    ) -> None:
        self.source, self.inventory, self.position = source, inventory, position
        self.updates: list[RemoteUpdate] = []

    def part(self, events: int) -> Callable[[], int]:
        """Read until caught up, as a measured part of ``events`` operations (the stream
        entries after the position)."""

        def read() -> int:
            while True:
                got = self.source.read(self.position, 0)
                if not got.updates:
                    return events
                self.updates.extend(got.updates)
                self.position = got.position

        return read

    def apply(self) -> float:
        """The calling thread's CPU seconds to apply what was read and encode it."""
        start = time.thread_time()
        self.inventory.apply(self.updates)
        encode_batch(self.inventory.take() or [])
        return time.thread_time() - start


def _follow(
    server: _Server,
    source: IndexRemoteSource,
    start: str,
    events: int,
    known: list[RemoteUpdate],
    rounds: int = 3,
) -> tuple[_PerOp, float, list[RemoteUpdate], str]:
    """Followers that already applied ``known`` read the ``events`` stream entries after
    ``start`` and apply them, ``rounds`` times afresh: the read's cost per event, the least
    CPU seconds of one apply, the updates read and the position reached."""
    followers = []
    for _ in range(rounds):
        inventory = RemoteInventory("opcosts-follower", BLOCK_SIZE, {TIER: "CPU"})
        inventory.apply(known)
        inventory.take()
        followers.append(_Follow(source, inventory, start))
    cost = _per_op(server, [f.part(events) for f in followers])
    apply_cpu = min(f.apply() for f in followers)
    return cost, apply_cpu, followers[0].updates, followers[0].position


def _inventory_bytes(updates: list[RemoteUpdate]) -> float:
    """Python heap a follower's RemoteInventory keeps per distinct remote chunk (token ids,
    block hashes, one claim per owner), after what it announced was taken."""
    chunks = len({(u.seed, u.key) for u in updates if u.stored})
    if not chunks:
        return 0.0
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        inventory = RemoteInventory("opcosts-follower", BLOCK_SIZE, {TIER: "CPU"})
        inventory.apply(updates)
        inventory.take()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()
    del inventory
    return kept / chunks


def _codec_costs(
    chains: list[list[ChunkRecord]], run_chunks: int, writer_id: str
) -> tuple[float, float]:
    """Seconds per event of :func:`codec.encode` and :func:`codec.decode` (stored runs)."""
    events: list[KVEvent] = []
    for chain in chains:
        for i in range(0, len(chain), run_chunks):
            batch: list[Update] = [("stored", rec) for rec in chain[i : i + run_chunks]]
            events += codec.batch_events(batch, writer_id, 1)
    start = time.thread_time()
    encoded = [codec.encode(ev) for ev in events]
    encode_s = time.thread_time() - start
    start = time.thread_time()
    for i, fields in enumerate(encoded):
        codec.decode(f"1-{i}", fields)
    decode_s = time.thread_time() - start
    return encode_s / len(events), decode_s / len(events)
