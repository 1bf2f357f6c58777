"""Daemon benchmark: the node daemon's client paths against what they would cost in process.

The daemon is always a separate ``kvfabric serve`` process that this script starts on a
temporary data dir (Unix socket, HTTP on loopback) and kills at the end. Every figure comes
from one run:

* ``client_put_vs_memcpy`` / ``client_get_vs_memcpy`` -- ``client.put_many`` (reserve 16
  objects, copy into the daemon's shared pages, commit them: two round trips) and
  ``client.get_many`` + ``read_into`` + ``release_many`` of 4 MiB objects, 16 per request as
  an engine saves or loads a step's chunks, divided by ``numpy.copyto`` of the same bytes
  into / out of as many preallocated slots in this process. ``*_single_vs_memcpy`` are the
  same with one object per request (``client.put`` / ``client.get``): there the two socket
  round trips per object cost about as much as the 4 MiB copy itself. The daemon's DRAM
  arena is pre-faulted and holds every object (nothing is evicted: checked), so the ratios
  are what the round trips cost on top of the one copy the shared-memory path makes.
* ``lookup_rpc_us_p50`` / ``_p99`` -- ``client.lookup(ns, keys=...)`` of a fully stored
  512-chunk chain through the socket; ``lookup_inproc_us_p50`` is the same lookup on a
  ``TieredStore`` in this process, ``rpc_ping_us_p50`` the bare round trip.
* ``small_ops_per_s_8_clients`` -- 8 client processes (spawned, one ``Client`` each) put a
  new 64 KiB object, then get and read it back, as fast as they can for a fixed time
  (against a second daemon whose arena holds everything they can write); the sum of their
  pairs per second.
* ``http_lookup_ms_p50`` -- the 512-chunk lookup through ``POST /v1/lookup`` on one
  persistent HTTP connection.

The copy comparisons run in interleaved rounds (which side goes first alternates), each
side's median per round, the ratio's median over rounds; a first round warms both up (and
maps the arena's pages into this process) and is discarded.

Run (``--quick``: under a minute; without it: a few minutes)::

    python benchmarks/daemon_bench.py --quick --json

``--json`` prints exactly one JSON object on stdout (the table goes to stderr).
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import (
    cpu_idle,
    host_cpu,
    measure,
    measure_pairs,
    median,
    memfd_pages,
    percentile,
    tokens,
    touched,
)
from _runner import Benchmark, Outcome, run_benchmark
from daemon_process import DaemonProcess
# isort: on

import argparse
import http.client
import json
import multiprocessing
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric.client import Client
from kvfabric.hashing import ChunkRef, chunk_hashes
from kvfabric.lookup import LookupResult
from kvfabric.protocol.messages import encode_namespace
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

KiB, MiB = 1 << 10, 1 << 20
OBJECT_BYTES = 4 * MiB
OBJECTS = 64  # 4 MiB objects per round: 256 MiB, as in store_bench
BATCH = 16  # objects per put_many / get_many: what an engine saves or loads per step
# Llama-3-8B-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16): 32 tokens make 4 MiB.
BIG = Namespace("bench-4mib", KVSpec(32, 8, 128, "bfloat16", chunk_tokens=32))
# 4 KiB chunks of 256 tokens: the lookup chain is cheap to store.
SMALL = Namespace("bench-small", KVSpec(1, 1, 4, "float16", chunk_tokens=256))
CHAIN_CHUNKS = 512  # a 128k-token prompt
SMALL_OP = Namespace("bench-64kib", KVSpec(4, 2, 64, "bfloat16", chunk_tokens=32))  # 64 KiB
SMALL_OP_BYTES = 64 * KiB
CLIENTS = 8
READY_TIMEOUT_S = 60.0

TARGETS: dict[str, tuple[str, float]] = {
    "client_put_vs_memcpy": (">=", 0.9),
    "client_get_vs_memcpy": (">=", 0.9),
    "lookup_rpc_us_p50": ("<=", 150),
}

FIGURES: list[tuple[str, str]] = [
    ("client_put_vs_memcpy", f"client.put_many {BATCH} x 4 MiB / np.copyto into as many slots"),
    ("client_get_vs_memcpy", f"client.get_many {BATCH} x 4 MiB + read_into / np.copyto out"),
    ("client_put_single_vs_memcpy", "client.put, one 4 MiB object per request / np.copyto"),
    ("client_get_single_vs_memcpy", "client.get + read_into, one per request / np.copyto"),
    ("client_put_gb_s", "client.put_many, GB/s"),
    ("client_get_gb_s", "client.get_many + read_into, GB/s"),
    ("memcpy_gb_s", f"np.copyto into {OBJECTS} rotating 4 MiB slots, GB/s"),
    ("memcpy_out_gb_s", f"np.copyto out of {OBJECTS} rotating 4 MiB slots, GB/s"),
    ("lookup_rpc_us_p50", "client.lookup, 512-chunk chain, all stored"),
    ("lookup_rpc_us_p99", "same, p99"),
    ("lookup_inproc_us_p50", "TieredStore.lookup in process, same chain"),
    ("rpc_ping_us_p50", "client.ping round trip"),
    ("http_lookup_ms_p50", "POST /v1/lookup, same chain, persistent connection"),
    ("small_ops_per_s_8_clients", "64 KiB put + get pairs/s, 8 client processes"),
    ("host_cpu", "host CPU (AMX: whether it has it)"),
    ("memfd_pages", "pages of the arenas (kernel shmem THP setting, huge pages free)"),
    ("cpu_idle", "cpuidle driver and poll window (kvfabric doctor: cpu.idle)"),
]


@dataclass(frozen=True)
class Settings:
    rounds: int  # measured copy rounds (plus one discarded warm-up round)
    lookups: int  # RPC and in-process lookups sampled
    pings: int
    http_lookups: int
    small_ops_s: float  # how long each small-ops client runs
    # Keys per client, and what the second daemon's pre-faulted arena is sized for: room for
    # 8k (quick) / 6.5k (full) pairs/s, about twice what a 2-core machine reaches; more
    # would cost start-up time (pre-faulting takes about a second per GiB).
    small_ops_max_pairs: int


QUICK = Settings(
    rounds=5,
    lookups=3_000,
    pings=3_000,
    http_lookups=100,
    small_ops_s=1.5,
    small_ops_max_pairs=1_536,
)
FULL = Settings(
    rounds=15,
    lookups=30_000,
    pings=30_000,
    http_lookups=1_000,
    small_ops_s=5.0,
    small_ops_max_pairs=4_096,
)


def dram_settings(capacity: int, page_size: int) -> list[str]:
    # Pre-faulted, so no put pays a first-touch fault; the SSD tier (which the daemon's
    # default tier list includes) stays small and, as checked, unused.
    return [
        f"store.tiers.dram.capacity={capacity}",
        f"store.tiers.dram.page_size={page_size}",
        "store.tiers.dram.prefault=true",
        "store.tiers.ssd.capacity=64MiB",
    ]


def arena_bytes(payload_bytes: int, page_size: int) -> int:
    """A DRAM tier that holds ``payload_bytes`` 75% full: below the demotion watermark."""
    return -(-payload_bytes * 4 // (3 * page_size)) * page_size


def gb_s(seconds: float) -> float:
    return OBJECT_BYTES / seconds / 1e9


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: median([r[name] for r in rounds]) for name in rounds[0]}


def check_nothing_moved(client: Client) -> None:
    dram = client.stats()["tiers"][0]
    if dram["evictions"] or dram["demotions"]:
        raise RuntimeError("the daemon's DRAM tier evicted objects: the run did not fit")


def bench_copies(client: Client, cfg: Settings) -> dict[str, float]:
    src = np.random.default_rng(1).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
    dst = touched(OBJECT_BYTES)
    slots = touched(OBJECTS * OBJECT_BYTES).reshape(OBJECTS, OBJECT_BYTES)
    refs = chunk_hashes(BIG, tokens(OBJECTS * BIG.spec.chunk_tokens, seed=1))

    def put(i: int) -> None:
        if not client.put(BIG, refs[i].key, src, parent=refs[i].parent):
            raise RuntimeError("key already stored: the put was not measured")

    def get(i: int) -> None:
        with client.get(BIG, refs[i].key) as reader:
            reader.read_into(dst)

    def batch(i: int) -> slice:
        return slice(i * BATCH, (i + 1) * BATCH)

    def copy_in_batch(i: int) -> None:
        for slot in slots[batch(i)]:
            np.copyto(slot, src)

    def copy_out_batch(i: int) -> None:
        for slot in slots[batch(i)]:
            np.copyto(dst, slot)

    def put_batch(i: int) -> None:
        if not all(client.put_many(BIG, refs[batch(i)], [src] * BATCH)):
            raise RuntimeError("key already stored: the put was not measured")

    def get_batch(i: int) -> None:
        readers = client.get_many(BIG, [r.key for r in refs[batch(i)]])
        for reader in readers:
            reader.read_into(dst)  # type: ignore[union-attr]
        client.release_many(readers)

    rounds = []
    for r in range(cfg.rounds + 1):
        (copy_in, put_s), (copy_out, get_s) = measure_pairs(
            [(lambda i: np.copyto(slots[i], src), put), (lambda i: np.copyto(dst, slots[i]), get)],
            OBJECTS,
            flip=r % 2 == 1,
        )
        for ref in refs:  # the next round puts into the same pages (the allocator is LIFO)
            client.delete(BIG, ref.key)
        (batch_in, put_many_s), (batch_out, get_many_s) = measure_pairs(
            [(copy_in_batch, put_batch), (copy_out_batch, get_batch)],
            OBJECTS // BATCH,
            flip=r % 2 == 1,
        )
        for ref in refs:
            client.delete(BIG, ref.key)
        rounds.append(
            {
                "client_put_vs_memcpy": batch_in / put_many_s,
                "client_get_vs_memcpy": batch_out / get_many_s,
                "client_put_single_vs_memcpy": copy_in / put_s,
                "client_get_single_vs_memcpy": copy_out / get_s,
                "client_put_gb_s": gb_s(put_many_s / BATCH),
                "client_get_gb_s": gb_s(get_many_s / BATCH),
                "memcpy_gb_s": gb_s(copy_in),
                "memcpy_out_gb_s": gb_s(copy_out),
            }
        )
    check_nothing_moved(client)
    return medians(rounds[1:])


def lookup_samples(
    lookup: Callable[[], LookupResult], keys: list[bytes], count: int
) -> list[float]:
    """Seconds per ``lookup()``, after checking it finds the whole chain and warming it up."""
    if lookup().matched_chunks != len(keys):
        raise RuntimeError("the chain is not fully stored")
    measure(lambda _: lookup(), count // 10)
    return measure(lambda _: lookup(), count)


def bench_lookup(
    client: Client, refs: list[ChunkRef], root: Path, cfg: Settings
) -> dict[str, float]:
    keys = [ref.key for ref in refs]
    payload = np.zeros(SMALL.spec.chunk_bytes, dtype=np.uint8)
    for ref in refs:
        client.put(SMALL, ref.key, payload, parent=ref.parent)
    rpc = lookup_samples(lambda: client.lookup(SMALL, keys=keys), keys, cfg.lookups)
    measure(lambda _: client.ping(), cfg.pings // 10)
    ping = measure(lambda _: client.ping(), cfg.pings)
    # The baseline: the same chain in a store in this process, no socket in between.
    chunk = SMALL.spec.chunk_bytes
    tier = TierConfig(TierKind.DRAM, len(refs) * chunk, page_size=chunk)
    config = StoreConfig(data_dir=str(root / "inproc"), tiers=(tier,))
    with TieredStore(config, maintenance=False) as store:
        for ref in refs:
            store.put(SMALL, ref.key, payload, parent=ref.parent)
        inproc = lookup_samples(lambda: store.lookup(SMALL, keys), keys, cfg.lookups)
    return {
        "lookup_rpc_us_p50": percentile(rpc, 50) * 1e6,
        "lookup_rpc_us_p99": percentile(rpc, 99) * 1e6,
        "lookup_inproc_us_p50": median(inproc) * 1e6,
        "rpc_ping_us_p50": median(ping) * 1e6,
    }


def bench_http_lookup(http_port: int, refs: list[ChunkRef], cfg: Settings) -> dict[str, float]:
    """The chain ``bench_lookup`` stored, looked up as a router would: over HTTP."""
    body = json.dumps(
        {"namespace": encode_namespace(SMALL), "chunk_hashes": [ref.key.hex() for ref in refs]}
    ).encode()
    headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)

    def lookup() -> dict[str, Any]:
        conn.request("POST", "/v1/lookup", body, headers)
        response = conn.getresponse()
        reply = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"POST /v1/lookup: {response.status} {reply}")
        return reply

    try:
        if lookup()["matched_chunks"] != len(refs):
            raise RuntimeError("the chain is not fully stored")
        measure(lambda _: lookup(), cfg.http_lookups // 10)
        samples = measure(lambda _: lookup(), cfg.http_lookups)
    finally:
        conn.close()
    return {"http_lookup_ms_p50": median(samples) * 1e3}


def small_ops_client(
    socket_path: str,
    index: int,
    seconds: float,
    max_pairs: int,
    start: Barrier,
    results: Queue[float | str],
) -> None:
    """One client process: reports its put + get pairs per second, or why it failed."""
    try:
        results.put(small_ops_rate(socket_path, index, seconds, max_pairs, start))
    except Exception as exc:
        start.abort()  # the others stop waiting (BrokenBarrierError) instead of hanging
        results.put(f"client {index}: {exc!r}")
        raise


def small_ops_rate(
    socket_path: str, index: int, seconds: float, max_pairs: int, start: Barrier
) -> float:
    src = np.random.default_rng(index).integers(0, 256, SMALL_OP_BYTES, dtype=np.uint8)
    dst = touched(SMALL_OP_BYTES)
    # Keys unique per client and pair; the store takes any 16 bytes as a key.
    keys = [(index << 64 | i).to_bytes(16, "little") for i in range(max_pairs)]
    with Client(socket_path) as client:
        client.ping()  # connected, arenas mapped, before the clock starts
        start.wait(READY_TIMEOUT_S)
        pairs = 0
        began = time.perf_counter()
        stop = began + seconds
        while time.perf_counter() < stop:
            if pairs == max_pairs:
                raise RuntimeError("ran out of keys: raise small_ops_max_pairs")
            if not client.put(SMALL_OP, keys[pairs], src):
                raise RuntimeError("key already stored: the put was not measured")
            with client.get(SMALL_OP, keys[pairs]) as reader:
                reader.read_into(dst)
            pairs += 1
        return pairs / (time.perf_counter() - began)


def bench_small_ops(socket_path: str, cfg: Settings) -> dict[str, float]:
    """Pairs/s of ``CLIENTS`` processes (spawned, like an engine's workers) over the same
    window: a barrier releases them together, each runs ``small_ops_s``; rates add up."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(CLIENTS)
    results: Queue[float | str] = ctx.Queue()
    procs = [
        ctx.Process(
            target=small_ops_client,
            args=(socket_path, i, cfg.small_ops_s, cfg.small_ops_max_pairs, start, results),
        )
        for i in range(CLIENTS)
    ]
    for proc in procs:
        proc.start()
    try:
        rates = [results.get(timeout=2 * READY_TIMEOUT_S) for _ in range(CLIENTS)]
    finally:
        for proc in procs:
            proc.join(10)
            proc.kill()
    failures = [r for r in rates if isinstance(r, str)]
    if failures:
        raise RuntimeError("; ".join(failures))
    with Client(socket_path) as client:
        check_nothing_moved(client)
    return {"small_ops_per_s_8_clients": sum(rates)}


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    cfg = QUICK if args.quick else FULL
    # Daemon 1: 256 KiB pages (the default), room for a round of 4 MiB objects.
    big_arena = arena_bytes(OBJECTS * OBJECT_BYTES, 256 * KiB)
    big = dram_settings(big_arena, 256 * KiB)
    pages = memfd_pages(big_arena)  # before the daemon takes any huge pages
    chain = chunk_hashes(SMALL, tokens(CHAIN_CHUNKS * SMALL.spec.chunk_tokens, seed=2))
    with (
        DaemonProcess(root / "node-big", big).start(READY_TIMEOUT_S) as node,
        Client(node.socket) as client,
    ):
        figures = {
            **bench_copies(client, cfg),
            **bench_lookup(client, chain, root, cfg),
            **bench_http_lookup(node.info["http_port"], chain, cfg),
        }
    # Daemon 2: one 64 KiB page per small object, room for every pair the clients may put.
    small = dram_settings(
        arena_bytes(CLIENTS * cfg.small_ops_max_pairs * SMALL_OP_BYTES, SMALL_OP_BYTES),
        SMALL_OP_BYTES,
    )
    with DaemonProcess(root / "node-small", small).start(READY_TIMEOUT_S) as node:
        figures.update(bench_small_ops(node.socket, cfg))
    figures["host_cpu"] = host_cpu()
    figures["memfd_pages"] = pages
    figures["cpu_idle"] = cpu_idle()
    return Outcome(figures)


BENCH = Benchmark(__doc__, "kvfabric-daemon-bench-", TARGETS, FIGURES)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
