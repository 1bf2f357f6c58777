"""The kvfabric LMCache plugin with real LMCache 0.5.6 objects on the CPU and live daemons:
LMCache's own RemoteBackend (and a whole LMCacheEngine) storing, finding and retrieving
chunks byte-exact through the daemon's shared pages; misses inside batches; a daemon that
restarts; tenants kept apart; and a second LMCache on another node pulling the chunks
through the global index."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvfabric.client import Client
from kvfabric_connectors.lmcache import KVFabricRemoteConnector, plugin_stats

CHUNK = 16
KV_SHAPE = (2, 2, CHUNK, 2, 32)  # vLLM's (layers, k|v, tokens, heads, head size)
TOKEN_BYTES = 2 * 2 * 2 * 32 * 2  # k|v x layers x heads x head size x bf16
SMALL = [
    "store.tiers.dram.capacity=256KiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
]


def plugin_config(socket: str, **settings: Any) -> LMCacheEngineConfig:
    p = "remote_storage_plugin.kvfabric."
    extra = {
        p + "module_path": "kvfabric_connectors.lmcache",
        p + "class_name": "KVFabricConnectorAdapter",
        p + "socket_path": socket,
        p + "retry_after_s": 0.2,
    }
    extra.update({p + k: v for k, v in settings.items()})
    return LMCacheEngineConfig.from_dict(
        {
            "chunk_size": CHUNK,
            "local_cpu": True,
            "max_local_cpu_size": 0.2,
            "remote_serde": "naive",
            "save_unfull_chunk": True,
            "pre_caching_hash_algorithm": "sha256_cbor",
            "remote_storage_plugins": ["kvfabric"],
            "extra_config": extra,
        }
    )


def metadata(model: str = "tiny-llama", worker_id: int = 0) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK,
    )


class Remote:
    """LMCache's RemoteBackend over the kvfabric plugin, with its CPU buffer."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        socket: str,
        model: str = "tiny-llama",
        **settings: Any,
    ) -> None:
        config = plugin_config(socket, **settings)
        md = metadata(model)
        self.cpu = LocalCPUBackend(config=config, metadata=md, dst_device="cpu")
        self.backend = RemoteBackend(config, md, loop, self.cpu, "cpu", plugin_name="kvfabric")
        assert self.backend.connection is not None, "the plugin did not load"
        self.connector = self.backend.connection.getWrappedConnector()
        assert isinstance(self.connector, KVFabricRemoteConnector)
        self.model = model

    def key(self, i: int, **tags: str) -> CacheEngineKey:
        configs = {f"lmcache.tag.{k}": v for k, v in tags.items()} or None
        return CacheEngineKey(
            self.model, 1, 0, 0x5EED0000 + i, torch.bfloat16, request_configs=configs
        )

    def obj(self, seed: int, tokens: int = CHUNK) -> Any:
        c = self.connector
        obj = self.cpu.allocate(c.meta_shapes, c.meta_dtypes, c.meta_fmt)
        if tokens != CHUNK:
            obj = c.reshape_partial_chunk(obj, tokens * TOKEN_BYTES)
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(torch.bfloat16))
        return obj

    def put(self, keys: list[CacheEngineKey], objs: list[Any]) -> None:
        for key, obj in zip(keys, objs):
            self.backend.submit_put_task(key, obj).result(10)

    def close(self) -> None:
        self.backend.close()


def same_bytes(a: Any, b: Any) -> bool:
    return a.tensor.shape == b.tensor.shape and torch.equal(
        a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)
    )


def test_store_lookup_and_retrieve_byte_exact_through_lmcache_remote_backend(
    start_daemon, lmcache_loop
) -> None:
    daemon = start_daemon()
    remote = Remote(lmcache_loop, daemon.socket)
    keys = [remote.key(i) for i in range(5)]
    objs = [remote.obj(i) for i in range(4)] + [remote.obj(4, tokens=5)]  # an unfull last
    refs = [o.get_ref_count() for o in objs]
    remote.put(keys, objs)
    assert [o.get_ref_count() for o in objs] == refs  # put gave back only what it took

    assert all(remote.backend.contains(k) for k in keys)
    assert remote.backend.batched_contains(keys) == 5
    for key, obj in zip(keys, objs):
        got = remote.backend.get_blocking(key)
        assert got is not None and same_bytes(got, obj)
        got.ref_count_down()
    assert remote.connector.stats()["bytes_written"] == (4 * CHUNK + 5) * TOKEN_BYTES

    # a second put of the same chunks is not rewritten
    remote.backend.batched_submit_put_task(keys, [remote.obj(99) for _ in keys])
    deadline = time.monotonic() + 5
    while remote.connector.stats()["put_existing"] < 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    got = remote.backend.get_blocking(keys[0])
    assert same_bytes(got, objs[0])

    # exists_sync is truly synchronous: safe on LMCache's own event loop thread
    async def on_loop() -> bool:
        return remote.connector.exists_sync(keys[1])

    assert asyncio.run_coroutine_threadsafe(on_loop(), lmcache_loop).result(5)
    assert plugin_stats()["kvfabric"]["get_hits"] >= 5
    remote.close()


def test_batches_with_misses_return_one_entry_per_key_and_count_prefixes(
    start_daemon, lmcache_loop
) -> None:
    daemon = start_daemon()
    remote = Remote(lmcache_loop, daemon.socket)
    keys = [remote.key(i) for i in range(6)]
    held = {0, 1, 3, 5}
    objs = {i: remote.obj(i) for i in held}
    remote.put([keys[i] for i in sorted(held)], [objs[i] for i in sorted(held)])

    got = remote.backend.batched_get_blocking(keys)
    assert len(got) == 6
    for i, obj in enumerate(got):
        if i in held:
            assert obj is not None and same_bytes(obj, objs[i])
            obj.ref_count_down()
        else:
            assert obj is None
    assert remote.backend.batched_contains(keys) == 2  # consecutive hits from the first
    assert remote.backend.batched_contains(keys[3:]) == 1
    assert remote.backend.batched_contains(keys[2:]) == 0

    async def async_paths() -> tuple[int, list[Any]]:
        count = await remote.backend.batched_async_contains("req", keys)
        prefix = await remote.backend.batched_get_non_blocking("req", keys)
        return count, prefix

    count, prefix = asyncio.run_coroutine_threadsafe(async_paths(), lmcache_loop).result(10)
    assert count == 2 and len(prefix) == 2
    assert all(same_bytes(o, objs[i]) for i, o in enumerate(prefix))
    stats = remote.connector.stats()
    assert stats["get_misses"] >= 2 and stats["lookups"] >= 4
    assert remote.backend.remove(keys[0]) and not remote.backend.contains(keys[0])
    remote.close()


def test_tenants_and_models_never_see_each_others_chunks(start_daemon, lmcache_loop) -> None:
    daemon = start_daemon()
    team_a = Remote(lmcache_loop, daemon.socket, tenant="team-a")
    team_b = Remote(lmcache_loop, daemon.socket, tenant="team-b")
    other_model = Remote(lmcache_loop, daemon.socket, model="other-model", tenant="team-a")
    keys = [team_a.key(i) for i in range(3)]
    team_a.put(keys, [team_a.obj(i) for i in range(3)])
    assert team_a.backend.batched_contains(keys) == 3
    assert team_b.backend.batched_contains(keys) == 0
    assert team_b.backend.batched_get_blocking(keys) == [None] * 3
    assert other_model.backend.batched_contains([other_model.key(i) for i in range(3)]) == 0
    # per-request tags are part of the key too
    assert not team_a.backend.contains(team_a.key(0, user="u1"))
    with Client(daemon.socket) as client:  # the daemon counts them as LMCache traffic
        counted = {
            (n["model_id"], n["tenant"]): n["hit_tokens"] for n in client.stats()["namespaces"]
        }
    assert counted[("lmcache:tiny-llama", "team-a")] >= 3 * CHUNK
    for remote in (team_a, team_b, other_model):
        remote.close()


def test_a_missing_daemon_is_a_miss_and_a_restarted_one_serves_its_ssd_again(
    start_daemon, lmcache_loop, tmp_path
) -> None:
    daemon = start_daemon(*SMALL, data_dir=tmp_path / "node")
    remote = Remote(lmcache_loop, daemon.socket)
    keys = [remote.key(i) for i in range(24)]  # 24 x 16 KiB: most spill to the SSD tier
    objs = [remote.obj(i) for i in range(24)]
    remote.put(keys, objs)
    assert remote.backend.batched_contains(keys) == 24
    assert daemon.stop() == 0

    # no daemon: misses and dropped puts, never an error in LMCache
    assert not remote.backend.contains(keys[0])
    assert remote.backend.get_blocking(keys[0]) is None
    assert remote.backend.batched_get_blocking(keys[:3]) == [None] * 3
    remote.put([remote.key(100)], [remote.obj(100)])

    start_daemon(*SMALL, data_dir=tmp_path / "node")
    deadline = time.monotonic() + 15
    while not any(remote.backend.contains(k) for k in keys):  # the plugin reconnects
        assert time.monotonic() < deadline, "the plugin did not reconnect"
        time.sleep(0.1)
    got = remote.backend.batched_get_blocking(keys)
    survived = [i for i, obj in enumerate(got) if obj is not None]
    assert len(survived) >= 12, survived
    for i in survived:
        assert same_bytes(got[i], objs[i])
        got[i].ref_count_down()
    remote.close()


class CPUKVCache(GPUConnectorInterface):
    """The serving engine's KV on the CPU: a dense [k|v, layers, tokens, hidden] tensor."""

    def __init__(self, kv_shape: tuple[int, ...]) -> None:
        self.kv_shape = kv_shape

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        layers, planes, _, heads, head_size = self.kv_shape
        return torch.Size([planes, layers, num_tokens, heads * head_size])


def lmcache_engine(name: str, socket: str) -> Any:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = LMCacheEngineBuilder.get_or_create(
        name,
        plugin_config(socket),
        metadata(),
        CPUKVCache(KV_SHAPE),
        lambda t, r: t,
        lambda o, r: o,
    )
    engine.post_init()
    return engine


def test_a_whole_lmcache_engine_stores_and_another_retrieves_through_the_daemon(
    start_daemon,
) -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    daemon = start_daemon()
    tokens = torch.arange(1000, 1000 + 2 * CHUNK + 7)  # two full chunks and an unfull one
    kv = torch.randn(2, KV_SHAPE[0], len(tokens), 64).to(torch.bfloat16)
    writer = lmcache_engine("kvf-writer", daemon.socket)
    reader = lmcache_engine("kvf-reader", daemon.socket)  # its own, empty CPU buffer
    try:
        writer.store(tokens, kvcaches=kv)
        deadline = time.monotonic() + 10
        while reader.lookup(tokens) < len(tokens):
            assert time.monotonic() < deadline, "the chunks never reached the daemon"
            time.sleep(0.05)
        out = torch.zeros_like(kv)
        found = reader.retrieve(tokens, kvcaches=out)
        assert int(found.sum()) == len(tokens)
        assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
        assert reader.lookup(torch.arange(5000, 5000 + CHUNK)) == 0
    finally:
        LMCacheEngineBuilder.destroy("kvf-writer")
        LMCacheEngineBuilder.destroy("kvf-reader")


def test_a_second_lmcache_on_another_node_pulls_the_chunks_through_the_global_index(
    redis_server, start_daemon, lmcache_loop
) -> None:
    def node(node_id: str) -> Any:
        return start_daemon(
            *SMALL,
            f"node_id={node_id}",
            "cluster.index=redis",
            f"cluster.redis_url={redis_server.url}",
            "cluster.lease_ttl_s=10",
            "cluster.heartbeat_s=0.2",
            "tcp.port=0",
            "cluster.transport=socket",
        )

    a, b = node("node-a"), node("node-b")
    on_a = Remote(lmcache_loop, a.socket, pull_timeout_s=5)
    on_b = Remote(lmcache_loop, b.socket, pull_timeout_s=5)
    keys = [on_a.key(i) for i in range(4)]
    objs = [on_a.obj(i) for i in range(3)] + [on_a.obj(3, tokens=9)]
    on_a.put(keys, objs)
    with Client(b.socket) as client:  # not on b's own tiers before the pull
        fkeys = [on_b.connector.kvfabric_key(k) for k in keys]
        assert client.contains(on_b.connector.namespace, fkeys) == [False] * 4

    deadline = time.monotonic() + 10
    while on_b.backend.batched_contains(keys) < 4:  # the index is updated asynchronously
        assert time.monotonic() < deadline, on_b.connector.stats()
        time.sleep(0.1)
    got = on_b.backend.batched_get_blocking(keys)
    for obj, want in zip(got, objs):
        assert obj is not None and same_bytes(obj, want)
        obj.ref_count_down()
    assert on_b.connector.stats()["pulled_chunks"] == 4
    with Client(b.socket) as client:  # now held by b itself
        assert client.contains(on_b.connector.namespace, fkeys) == [True] * 4
    on_a.close()
    on_b.close()


def test_an_object_over_one_chunk_is_refused_for_its_size_not_as_a_fraction_of_a_token(
    start_daemon, lmcache_loop, caplog
) -> None:
    """Regression: on the old code an object of 32 whole tokens (two chunks' worth) was
    refused as "not a whole number of tokens", which sent users after remote_serde."""
    daemon = start_daemon()
    remote = Remote(lmcache_loop, daemon.socket)
    c = remote.connector
    shape = list(c.meta_shapes[0])
    shape[shape.index(CHUNK)] = 2 * CHUNK
    big = remote.cpu.allocate([torch.Size(shape)], c.meta_dtypes, c.meta_fmt)
    assert big is not None and len(big.byte_array) == 2 * CHUNK * TOKEN_BYTES
    with caplog.at_level("WARNING", logger="kvfabric_connectors.lmcache.connector"):
        remote.put([remote.key(0)], [big])
    refused = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert len(refused) == 1
    assert "holds 32 tokens, more than one 16-token chunk" in refused[0]
    assert "whole number" not in refused[0]
    assert c.stats()["put_failed"] == 1 and c.stats()["put_stored"] == 0
    big.ref_count_down()
    remote.close()


def test_unstorable_names_what_is_wrong_with_an_object() -> None:
    from kvfabric_connectors.lmcache.connector import unstorable

    assert unstorable(5 * TOKEN_BYTES, TOKEN_BYTES, CHUNK) is None  # an unfull last chunk
    assert unstorable(CHUNK * TOKEN_BYTES, TOKEN_BYTES, CHUNK) is None
    assert "whole number" in unstorable(TOKEN_BYTES + 1, TOKEN_BYTES, CHUNK)
    assert "empty" in unstorable(0, TOKEN_BYTES, CHUNK)
    assert "more than one" in unstorable(3 * CHUNK * TOKEN_BYTES, TOKEN_BYTES, CHUNK)
