"""Cluster benchmark: pulls and pushes between two daemons against the raw peer transport,
and the Redis global index's lookup, update and event rates.

Everything runs on loopback in one run: a private ``redis-server`` (no persistence, on a free
port) and two ``kvfabric serve`` processes (``node-a``, ``node-b``) that share it as their
global index (``cluster.index=redis``, ``tcp.port=0``, ``cluster.transport=...``); all of
them are killed at the end.

* ``pull_vs_raw_transport`` -- GB/s of ``client.prefetch`` on B of a 64 MiB chain (16 x 4 MiB
  chunks) stored on A, end to end (global lookup, transfer, insert into B's arena), divided by
  the GB/s of the raw transport reading the same 16 x 4 MiB from a helper process's
  registered 64 MiB buffer into one registered in this process (one ``read`` call, same
  backend), both buffers the same kind of memory the daemons register: memfd shared memory
  (``SharedArena``). ``raw_read_anonymous_gb_s`` is the same read between anonymous buffers
  (numpy asks for transparent huge pages on those; a memfd gets them only where the kernel's
  ``shmem_enabled`` allows): what the memory kind costs, measured apart from the fabric.
  ``transport`` is the backend ``cluster.transport=auto`` resolved to here; with
  ``--all-transports`` socket and nixl also run separately (``*_socket`` / ``*_nixl``).
* ``push_vs_raw_transport`` -- the same for ``client.push`` from A to B against one raw
  ``write`` of the 16 pieces.
* ``global_lookup_512_ms_p50`` -- ``RedisGlobalIndex.lookup(seed, keys)`` of a 512-chunk chain
  one node published (``redis_ping_ms_p50``: the bare round trip, for scale).
* ``index_updates_per_s`` -- chunk records one index client gets into Redis per second
  (``publish`` of N unchained records, then ``flush``: one stream event each).
* ``events_per_s`` -- KV events a consumer reads per second with ``events(after_id,
  count=1000)`` over that stream of N events.

Transfer rounds alternate which side (raw or daemon) goes first; a first round warms up
and is discarded; each ratio is the median over rounds of per-round ratios.

Run (``--quick``: under a minute)::

    python benchmarks/cluster_bench.py --quick --json

``--json`` prints exactly one JSON object on stdout (the table goes to stderr).
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import measure, median, percentile, tokens, touched
from _runner import Benchmark, Outcome, run_benchmark
from daemon_process import DaemonProcess
from redis_process import RedisServer
# isort: on

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from kvfabric.client import Client
from kvfabric.cluster.index import ChunkRecord, NodeInfo
from kvfabric.cluster.redis_index import RedisGlobalIndex
from kvfabric.hashing import chunk_hashes
from kvfabric.memory.arena import SharedArena
from kvfabric.spec import KVSpec, Namespace
from kvfabric.transport import (
    ReadPiece,
    SocketTransport,
    Transport,
    WritePiece,
    nixl_unavailable_reason,
    select_backend,
)

KiB, MiB = 1 << 10, 1 << 20
CHUNK_BYTES = 4 * MiB
CHUNKS = 16  # 64 MiB per transfer
ARENA_PAGE = 256 * KiB  # the daemons' DRAM page size here
TOTAL_BYTES = CHUNKS * CHUNK_BYTES
# Llama-3-8B-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16): 32 tokens make 4 MiB.
BIG = Namespace("bench-cluster-4mib", KVSpec(32, 8, 128, "bfloat16", chunk_tokens=32))
CHAIN_CHUNKS = 512
READY_TIMEOUT_S = 60.0
DEADLINE_S = 30.0

TARGETS: dict[str, tuple[str, float]] = {
    "pull_vs_raw_transport": (">=", 0.8),
    "push_vs_raw_transport": (">=", 0.8),
    "global_lookup_512_ms_p50": ("<=", 1.0),
}


@dataclass(frozen=True)
class Settings:
    rounds: int  # measured transfer rounds (plus one discarded warm-up round)
    lookups: int
    records: int  # index records published / events read


QUICK = Settings(rounds=3, lookups=500, records=20_000)
FULL = Settings(rounds=10, lookups=5_000, records=200_000)


# -- processes ------------------------------------------------------------------------------
def node(data_dir: Path, redis_url: str, node_id: str, transport: str) -> DaemonProcess:
    """A running ``kvfabric serve`` child (a ``with`` block kills it when it ends)."""
    settings = node_settings(redis_url, node_id, transport)
    return DaemonProcess(data_dir, settings).start(READY_TIMEOUT_S)


def node_settings(redis_url: str, node_id: str, transport: str) -> list[str]:
    # Pre-faulted DRAM arena with room for the 64 MiB chain at under 75% full.
    return [
        "store.tiers.dram.capacity=128MiB",
        "store.tiers.dram.page_size=256KiB",
        "store.tiers.dram.prefault=true",
        "store.tiers.ssd.capacity=64MiB",
        f"node_id={node_id}",
        "cluster.index=redis",
        f"cluster.redis_url={redis_url}",
        "cluster.lease_ttl_s=10",
        "cluster.heartbeat_s=0.5",
        "tcp.port=0",
        f"cluster.transport={transport}",
    ]


def make_transport(backend: type[Transport], name: str) -> Transport:
    if backend is SocketTransport:
        return SocketTransport(name, host="127.0.0.1")
    return backend(name)


def raw_buffers() -> tuple[SharedArena, np.ndarray]:
    """64 MiB of the daemons' kind of memory (region 0) and of anonymous memory (region 1)."""
    arena = SharedArena.create(TOTAL_BYTES, ARENA_PAGE, prefault=True)
    return arena, touched(TOTAL_BYTES)


def raw_peer(preferred: str, descriptors: Any, stop: Any) -> None:
    """Helper process: registers two 64 MiB buffers, publishes its descriptor, serves them."""
    backend = select_backend(preferred)
    arena, anonymous = raw_buffers()
    data = np.random.default_rng(3).integers(0, 256, TOTAL_BYTES, dtype=np.uint8)
    arena.array[:] = data
    anonymous[:] = data
    transport = make_transport(backend, "bench-raw-peer")
    try:
        transport.register(0, arena.array)
        transport.register(1, anonymous)
        descriptors.put(transport.descriptor())
        stop.wait(600)
    finally:
        transport.close()
        arena.close()


# -- transfers ------------------------------------------------------------------------------
def put_chain(socket_path: str) -> list[bytes]:
    refs = chunk_hashes(BIG, tokens(CHUNKS * BIG.spec.chunk_tokens, seed=5))
    rng = np.random.default_rng(7)
    payloads = [rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for _ in refs]
    with Client(socket_path) as client:
        if not all(client.put_many(BIG, refs, payloads)):
            raise RuntimeError("chain already stored on node-a")
    return [r.key for r in refs]


def wait_until_held(index: RedisGlobalIndex, keys: list[bytes], node: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        prefix = index.lookup(BIG.seed, keys).nodes().get(node)
        if prefix is not None and prefix.chunks == len(keys):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the global index never showed the chain on {node}")
        time.sleep(0.05)


def bench_transfers(root: Path, redis_url: str, preferred: str, cfg: Settings) -> dict[str, float]:
    backend = select_backend(preferred)
    ctx = multiprocessing.get_context("spawn")
    descriptors, stop = ctx.Queue(), ctx.Event()
    helper = ctx.Process(target=raw_peer, args=(preferred, descriptors, stop))
    helper.start()
    arena, anonymous = raw_buffers()
    local = arena.array
    transport = make_transport(backend, "bench-raw-local")
    tag = f"{preferred}-{time.monotonic_ns()}"
    try:
        transport.register(0, local)
        transport.register(1, anonymous)
        peer = transport.connect(descriptors.get(timeout=READY_TIMEOUT_S), DEADLINE_S)
        reads = [
            ReadPiece(0, i * CHUNK_BYTES, local[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])
            for i in range(CHUNKS)
        ]
        writes = [
            WritePiece(local[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES], 0, i * CHUNK_BYTES)
            for i in range(CHUNKS)
        ]
        anonymous_reads = [
            ReadPiece(1, i * CHUNK_BYTES, anonymous[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])
            for i in range(CHUNKS)
        ]

        with (
            node(root / f"a-{tag}", redis_url, "node-a", preferred) as a,
            node(root / f"b-{tag}", redis_url, "node-b", preferred) as b,
            Client(a.socket) as ca,
            Client(b.socket) as cb,
            RedisGlobalIndex(redis_url) as index,
        ):
            keys = put_chain(a.socket)
            wait_until_held(index, keys, "node-a")

            def pull(_: int) -> None:
                result = cb.prefetch(BIG, keys=keys, timeout=DEADLINE_S)
                if result["pulled"] != CHUNKS:
                    raise RuntimeError(f"prefetch did not pull the chain: {result}")

            def push(_: int) -> None:
                result = ca.push(BIG, keys, "node-b", timeout=DEADLINE_S)
                if result["pushed"] != CHUNKS:
                    raise RuntimeError(f"push did not push the chain: {result}")

            def clear_b() -> None:
                for key in keys:
                    cb.delete(BIG, key)

            def raw_read(_: int) -> None:
                transport.read(peer, reads, DEADLINE_S)

            def raw_write(_: int) -> None:
                transport.write(peer, writes, DEADLINE_S)

            def raw_read_anonymous(_: int) -> None:
                transport.read(peer, anonymous_reads, DEADLINE_S)

            rounds = []
            for r in range(cfg.rounds + 1):
                # one sample each, alternating who goes first; B is emptied between ops
                order = [
                    ("raw_read", raw_read),
                    ("pull", pull),
                    ("raw_read_anonymous", raw_read_anonymous),
                ]
                order2 = [("raw_write", raw_write), ("push", push)]
                if r % 2:
                    order.reverse()
                    order2.reverse()
                t: dict[str, float] = {}
                for name, fn in [*order, *order2]:
                    t[name] = measure(fn, 1)[0]
                    if name in ("pull", "push"):
                        clear_b()
                rounds.append(t)
        rounds = rounds[1:]
    finally:
        stop.set()
        helper.join(10)
        if helper.is_alive():
            helper.kill()
        transport.close()
        arena.close()

    def gbs(seconds: float) -> float:
        return TOTAL_BYTES / seconds / 1e9

    return {
        "pull_vs_raw_transport": median([x["raw_read"] / x["pull"] for x in rounds]),
        "push_vs_raw_transport": median([x["raw_write"] / x["push"] for x in rounds]),
        "pull_gb_s": gbs(median([x["pull"] for x in rounds])),
        "push_gb_s": gbs(median([x["push"] for x in rounds])),
        "raw_read_gb_s": gbs(median([x["raw_read"] for x in rounds])),
        "raw_write_gb_s": gbs(median([x["raw_write"] for x in rounds])),
        "raw_read_anonymous_gb_s": gbs(median([x["raw_read_anonymous"] for x in rounds])),
    }


# -- index ----------------------------------------------------------------------------------
def bench_index(redis_url: str, cfg: Settings) -> dict[str, float]:
    seed = BIG.seed
    chain = chunk_hashes(BIG, tokens(CHAIN_CHUNKS * BIG.spec.chunk_tokens, seed=9))
    keys = [r.key for r in chain]
    with RedisGlobalIndex(redis_url, prefix="benchlookup") as index:
        index.register(NodeInfo("bench-node", "127.0.0.1:1", ("dram",)))
        index.publish(
            [ChunkRecord(seed, r.key, "dram", r.parent, BIG.spec.chunk_tokens) for r in chain]
        )
        index.flush(30)
        if index.lookup(seed, keys).matched_chunks != CHAIN_CHUNKS:
            raise RuntimeError("the published chain is not found")
        measure(lambda _: index.lookup(seed, keys), cfg.lookups // 10)
        lookups = measure(lambda _: index.lookup(seed, keys), cfg.lookups)
    ping_client = redis.Redis.from_url(redis_url)
    measure(lambda _: ping_client.ping(), 100)
    pings = measure(lambda _: ping_client.ping(), cfg.lookups)
    ping_client.close()

    # N independent chunks (parent ROOT): one record and one stream event each.
    rng = np.random.default_rng(11)
    records = [ChunkRecord(seed, rng.bytes(16), "dram", num_tokens=32) for _ in range(cfg.records)]
    with RedisGlobalIndex(redis_url, prefix="benchupd", max_events=2 * cfg.records) as index:
        index.register(NodeInfo("bench-writer", "127.0.0.1:2", ("dram",)))
        start = time.perf_counter()
        index.publish(records)
        index.flush(300)
        updates_s = time.perf_counter() - start
    with RedisGlobalIndex(redis_url, prefix="benchupd") as consumer:
        read = 0
        after = "0-0"
        start = time.perf_counter()
        while read < cfg.records:
            batch = consumer.events(after, count=1000)
            if not batch:
                raise RuntimeError(f"stream ended after {read} of {cfg.records} events")
            read += len(batch)
            after = batch[-1].stream_id
        events_s = time.perf_counter() - start
    return {
        "global_lookup_512_ms_p50": percentile(lookups, 50) * 1e3,
        "global_lookup_512_ms_p99": percentile(lookups, 99) * 1e3,
        "redis_ping_ms_p50": median(pings) * 1e3,
        "index_updates_per_s": cfg.records / updates_s,
        "events_per_s": read / events_s,
    }


def transport_name(preferred: str) -> str:
    return select_backend(preferred).backend


def all_transports_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--all-transports",
        action="store_true",
        help="also measure pull/push on socket and nixl separately",
    )


BENCH = Benchmark(
    __doc__, "kvfabric-cluster-bench-", TARGETS, (), add_arguments=all_transports_option
)


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """fd 1 goes to stderr inside the block: NIXL logs to stdout (here and in the spawned
    helper), and with --json stdout carries only the JSON object."""
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    cfg = QUICK if args.quick else FULL
    described: list[tuple[str, str]] = []
    figures: dict[str, Any] = {}
    with stdout_to_stderr(), RedisServer(root).start() as server:
        url = f"redis://127.0.0.1:{server.port}"
        auto = transport_name("auto")
        figures.update(bench_transfers(root, url, "auto", cfg))
        described += [
            ("pull_vs_raw_transport", f"client.prefetch {CHUNKS} x 4 MiB ({auto}) / raw read"),
            ("push_vs_raw_transport", f"client.push {CHUNKS} x 4 MiB ({auto}) / raw write"),
            ("pull_gb_s", "prefetch on B of A's 64 MiB chain, GB/s"),
            ("push_gb_s", "push A -> B of 64 MiB, GB/s"),
            ("raw_read_gb_s", f"{auto} transport read, 64 MiB between processes, GB/s"),
            ("raw_write_gb_s", f"{auto} transport write, 64 MiB, GB/s"),
            ("raw_read_anonymous_gb_s", f"{auto} read between anonymous (THP) buffers, GB/s"),
        ]
        if args.all_transports:
            for backend in ("socket", "nixl"):
                if backend == "nixl" and nixl_unavailable_reason() is not None:
                    print(f"nixl unavailable: {nixl_unavailable_reason()}", file=sys.stderr)
                    continue
                got = bench_transfers(root, url, backend, cfg)
                for kind in ("pull", "push"):
                    name = f"{kind}_vs_raw_transport_{backend}"
                    figures[name] = got[f"{kind}_vs_raw_transport"]
                    described.append((name, f"same, cluster.transport={backend}"))
        figures.update(bench_index(url, cfg))
        described += [
            ("global_lookup_512_ms_p50", "RedisGlobalIndex.lookup, 512-chunk chain"),
            ("global_lookup_512_ms_p99", "same, p99"),
            ("redis_ping_ms_p50", "bare redis PING round trip, for scale"),
            ("index_updates_per_s", f"publish + flush of {cfg.records} chunk records"),
            ("events_per_s", f"events(after_id, count=1000) over {cfg.records} events"),
        ]
    figures["transport"] = auto  # not a table row: goes into the JSON object only
    print(
        f"transport: {auto} (cluster.transport=auto)", file=sys.stderr if args.json else sys.stdout
    )
    return Outcome(figures, described)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
