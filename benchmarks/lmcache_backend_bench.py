"""LMCache remote backends: the kvfabric plugin against LMCache's own Redis backend and its
own ``lm://`` server, all driven by LMCache 0.5.6's ``RemoteBackend`` on the CPU.

One run stores and retrieves the same chunks (LMCache ``MemoryObj`` s of ``chunk_size``
tokens, 4 layers x 8 KV heads x 128 x bf16: 4 MiB each) through each backend:

* (a) ``plugin://kvfabric``: a ``kvfabric serve`` child process on a temporary data dir
  (DRAM large enough for every chunk: nothing is evicted);
* (b) ``redis://``: LMCache's ``RedisConnector`` on a real ``redis-server`` child on a random
  loopback port, no persistence;
* (c) ``lm://``: ``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` (skipped, and
  ``get_vs_lm_server`` left out, if it does not come up or answer in time).

Figures (each a median over rounds; every round uses new keys, so no backend can skip a
put of a chunk it already holds):

* ``put_vs_redis_backend`` -- seconds for the Redis backend to store a batch of chunks
  (the connector's ``batched_put``, as ``RemoteBackend.batched_submit_put_task`` issues it,
  until it is done) divided by the same for kvfabric: > 1 means kvfabric is faster.
* ``get_vs_redis_backend`` / ``get_vs_lm_server`` -- the same ratio for
  ``batched_get_blocking`` of the batch (objects allocated from LMCache's CPU buffer, bytes
  checked once per backend).
* ``lookup_ms_p50_kvfabric`` / ``lookup_ms_p50_redis_backend`` -- ``batched_contains`` (the
  prefix count LMCache asks before a retrieve) of every chunk stored so far.

Run (``--quick``: under a minute)::

    python benchmarks/lmcache_backend_bench.py --quick --json

``--json`` prints exactly one JSON object on stdout (the table goes to stderr).
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import measure, median
from _runner import Benchmark, Outcome, run_benchmark
from child_process import Child, free_port
from daemon_process import DaemonProcess
from redis_process import RedisServer
# isort: on

import argparse
import asyncio
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch

CHUNK_TOKENS = 256
KV_SHAPE = (4, 2, CHUNK_TOKENS, 8, 128)  # vLLM's (layers, k|v, tokens, heads, head size)


@dataclass(frozen=True)
class Config:
    batch: int  # chunks per put / get
    rounds: int
    lookups: int


QUICK = Config(batch=8, rounds=5, lookups=50)
FULL = Config(batch=16, rounds=15, lookups=300)
TARGETS = {"put_vs_redis_backend": (">=", 2.0), "get_vs_redis_backend": (">=", 2.0)}
FIGURES = [
    ("put_vs_redis_backend", "Redis backend put time / kvfabric put time (batch of chunks)"),
    ("get_vs_redis_backend", "Redis backend get time / kvfabric get time (batch of chunks)"),
    ("get_vs_lm_server", "lm:// server get time / kvfabric get time (batch of chunks)"),
    ("put_vs_lm_server", "lm:// server put time / kvfabric put time (batch of chunks)"),
    ("lookup_ms_p50_kvfabric", "batched_contains of every stored chunk, kvfabric (ms)"),
    ("lookup_ms_p50_redis_backend", "the same through the Redis backend (ms)"),
    ("put_ms_kvfabric", "one batch put, kvfabric (ms)"),
    ("get_ms_kvfabric", "one batch get, kvfabric (ms)"),
    ("chunk_mib", "size of one chunk (MiB)"),
]


@contextmanager
def lm_server_process(workdir: Path) -> Iterator[str | None]:
    """LMCache's own remote server; None if it does not come up within 30 s."""
    port = free_port()
    argv = [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]
    server = Child("lm_server", argv, workdir / "lm_server.log").start()
    try:
        deadline = time.monotonic() + 30
        url: str | None = None
        while time.monotonic() < deadline and server.alive:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                url = f"lm://127.0.0.1:{port}"
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        server.kill()


class Backend:
    """LMCache's RemoteBackend with its CPU buffer and event loop thread."""

    def __init__(
        self, name: str, overrides: dict[str, Any], plugin: str | None, cpu_gib: float
    ) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        self.name = name
        config = LMCacheEngineConfig.from_dict(
            {
                "chunk_size": CHUNK_TOKENS,
                "local_cpu": True,
                "max_local_cpu_size": cpu_gib,
                "remote_serde": "naive",
                "blocking_timeout_secs": 30,
                **overrides,
            }
        )
        md = LMCacheMetadata(
            model_name=f"bench-{name}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=KV_SHAPE,
            chunk_size=CHUNK_TOKENS,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cpu = LocalCPUBackend(config=config, metadata=md, dst_device="cpu")
        self.backend = RemoteBackend(config, md, self.loop, self.cpu, "cpu", plugin_name=plugin)
        if self.backend.connection is None:
            raise RuntimeError(f"LMCache could not connect the {name} backend")
        self.model = md.model_name
        self.next_key = 0

    def keys(self, count: int) -> list[Any]:
        from lmcache.utils import CacheEngineKey

        first, self.next_key = self.next_key, self.next_key + count
        return [
            CacheEngineKey(self.model, 1, 0, 0xC0FFEE00 + i, torch.bfloat16)
            for i in range(first, first + count)
        ]

    def put(self, keys: list[Any], objs: list[Any]) -> None:
        """What ``RemoteBackend.batched_submit_put_task`` (LMCache's store path) does, but
        waiting for the end: the naive serializer's reference, then the connector's
        ``batched_put`` on LMCache's loop (its wrapper gives the reference back)."""
        connection = self.backend.connection
        assert connection is not None
        for obj in objs:
            obj.ref_count_up()
        if connection.support_batched_put():
            job = connection.batched_put(keys, objs)
        else:  # one put per chunk, all in flight (submit_put_task per chunk)
            job = _gathered([connection.put(k, o) for k, o in zip(keys, objs)])
        asyncio.run_coroutine_threadsafe(job, self.loop).result(60)

    def get(self, keys: list[Any]) -> list[Any]:
        got = self.backend.batched_get_blocking(keys)
        if any(o is None for o in got):
            raise RuntimeError(f"{self.name}: a stored chunk was not found")
        return got

    def close(self) -> None:
        # LMCache 0.5.6's RemoteBackend.close() can hang (redis): give it a few seconds
        closer = threading.Thread(target=self.backend.close, daemon=True)
        closer.start()
        closer.join(5)
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _gathered(jobs: list[Any]) -> Any:
    return await asyncio.gather(*jobs)


def make_objs(backend: Backend, count: int) -> list[Any]:
    conn = backend.backend.connection.getWrappedConnector()  # type: ignore[union-attr]
    objs = []
    for i in range(count):
        obj = backend.cpu.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
        gen = torch.Generator().manual_seed(i)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(torch.bfloat16))
        objs.append(obj)
    return objs


def bench_backend(backend: Backend, cfg: Config) -> dict[str, Any]:
    """Median seconds of a batch put and a batch get, and lookup samples."""
    objs = make_objs(backend, cfg.batch)
    stored: list[Any] = []
    put_s: list[float] = []
    get_s: list[float] = []

    def one_round(check: bool) -> tuple[float, float]:
        keys = backend.keys(cfg.batch)
        start = time.perf_counter()
        backend.put(keys, objs)
        put = time.perf_counter() - start
        start = time.perf_counter()
        got = backend.get(keys)
        get = time.perf_counter() - start
        if check:
            for obj, want in zip(got, objs):
                assert torch.equal(obj.tensor.view(torch.uint8), want.tensor.view(torch.uint8))
        for obj in got:
            obj.ref_count_down()
        stored.extend(keys)
        return put, get

    one_round(check=True)  # warm-up (connections, page faults), bytes checked
    for _ in range(cfg.rounds):
        put, get = one_round(check=False)
        put_s.append(put)
        get_s.append(get)
    lookups = measure(lambda _: backend.backend.batched_contains(stored), cfg.lookups)
    found = backend.backend.batched_contains(stored)
    if found != len(stored):
        raise RuntimeError(f"{backend.name}: lookup found {found} of {len(stored)} chunks")
    return {"put_s": median(put_s), "get_s": median(get_s), "lookup_ms_p50": median(lookups) * 1e3}


def run_one(make: Callable[[], Backend], cfg: Config) -> dict[str, Any] | None:
    backend = make()
    try:
        return bench_backend(backend, cfg)
    finally:
        backend.close()


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    cfg = QUICK if args.quick else FULL
    chunk_bytes = 2 * KV_SHAPE[0] * CHUNK_TOKENS * KV_SHAPE[3] * KV_SHAPE[4] * 2
    total = chunk_bytes * cfg.batch * (cfg.rounds + 1)
    cpu_gib = max(1.0, 4 * chunk_bytes * cfg.batch / 2**30)
    results: dict[str, dict[str, Any]] = {}
    dram = f"store.tiers.dram.capacity={max(1, 2 * total // 2**30 + 1)}GiB"
    settings = [dram, "store.tiers.dram.page_size=2MiB"]
    with DaemonProcess(root / "kvfabric", settings).start() as daemon:
        plugin = "remote_storage_plugin.kvfabric."
        overrides = {
            "remote_storage_plugins": ["kvfabric"],
            "extra_config": {
                plugin + "module_path": "kvfabric_connectors.lmcache",
                plugin + "class_name": "KVFabricConnectorAdapter",
                plugin + "socket_path": daemon.socket,
                plugin + "pull": False,
            },
        }
        results["kvfabric"] = run_one(
            lambda: Backend("kvfabric", overrides, "kvfabric", cpu_gib), cfg
        )
    (root / "redis").mkdir()
    with RedisServer(root / "redis").start() as server:
        url = f"redis://127.0.0.1:{server.port}"
        results["redis"] = run_one(
            lambda: Backend("redis", {"remote_url": url}, None, cpu_gib), cfg
        )
    with lm_server_process(root) as url:
        if url is not None:
            try:
                results["lm"] = run_one(
                    lambda: Backend("lm", {"remote_url": url}, None, cpu_gib), cfg
                )
            except Exception as exc:  # a baseline that fails here is left out, said so
                print(f"lm:// server baseline skipped: {exc!r}", file=sys.stderr)
        else:
            print("lm:// server baseline skipped: it did not come up", file=sys.stderr)

    kvf, redis_ = results["kvfabric"], results["redis"]
    figures = {
        "put_vs_redis_backend": redis_["put_s"] / kvf["put_s"],
        "get_vs_redis_backend": redis_["get_s"] / kvf["get_s"],
        "lookup_ms_p50_kvfabric": kvf["lookup_ms_p50"],
        "lookup_ms_p50_redis_backend": redis_["lookup_ms_p50"],
        "put_ms_kvfabric": kvf["put_s"] * 1e3,
        "get_ms_kvfabric": kvf["get_s"] * 1e3,
        "chunk_mib": chunk_bytes / 2**20,
    }
    if "lm" in results:
        figures["get_vs_lm_server"] = results["lm"]["get_s"] / kvf["get_s"]
        figures["put_vs_lm_server"] = results["lm"]["put_s"] / kvf["put_s"]
    return Outcome(figures)


BENCH = Benchmark(__doc__, "kvfabric-lmcache-bench-", TARGETS, FIGURES)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
