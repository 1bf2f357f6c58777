"""The LMCache ``RemoteConnector`` backed by the node's kvfabric daemon, and its adapter.

See the package docstring for the contract with LMCache and :mod:`.keys` for the mapping
of LMCache keys to kvfabric namespaces and chunk keys.
"""

from __future__ import annotations

import asyncio
import builtins  # the class's own `list` method shadows the type in its annotations
import logging
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvfabric.client import Client
from kvfabric.client.objects import RemoteReader, RemoteWriter
from kvfabric.counters import Counters
from kvfabric.errors import (
    AlreadyExistsError,
    KVFabricError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)
from kvfabric.hashing import ROOT, ChunkRef
from kvfabric_connectors.link import DaemonLink, held_prefix

from .keys import chunk_key, layout_tag, namespace_for, opaque_spec
from .settings import PluginSettings

log = logging.getLogger(__name__)

PLUGIN_TYPE = "kvfabric"
T = TypeVar("T")

_LIVE: weakref.WeakSet[KVFabricRemoteConnector] = weakref.WeakSet()
COUNTERS = (
    "lookups",
    "lookup_keys",
    "lookup_hits",
    "gets",
    "get_hits",
    "get_misses",
    "bytes_read",
    "puts",
    "put_stored",
    "put_existing",
    "put_failed",
    "bytes_written",
    "pulls",
    "pulled_chunks",
    "errors",
)


class _Collector:
    """``kvfabric_plugin_*{engine="lmcache",plugin=...}`` in prometheus_client's registry."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        for name in COUNTERS:
            family = CounterMetricFamily(
                f"kvfabric_plugin_{name}",
                f"kvfabric LMCache plugin: {name.replace('_', ' ')}",
                labels=["engine", "plugin"],
            )
            for plugin, counts in sorted(plugin_stats().items()):
                family.add_metric(["lmcache", plugin], counts[name])
            yield family


def _register_collector() -> None:
    try:
        from prometheus_client import REGISTRY

        REGISTRY.register(_Collector())
    except Exception as exc:  # no prometheus_client, or registered twice: counters stay
        log.debug("kvfabric plugin metrics not exported: %s", exc)


def plugin_stats() -> dict[str, dict[str, int]]:
    """Counters of every live connector of this process, by plugin name."""
    out: dict[str, dict[str, int]] = {}
    for connector in list(_LIVE):
        mine = out.setdefault(connector.plugin_name, dict.fromkeys(COUNTERS, 0))
        for name, value in connector.stats().items():
            mine[name] += value
    return out


def unstorable(nbytes: int, token_bytes: int, chunk_tokens: int) -> str | None:
    """Why an object of ``nbytes`` cannot be stored as one chunk (None: it can): it must be
    a whole number of tokens, at least one and at most ``chunk_tokens``."""
    tokens, rest = divmod(nbytes, token_bytes)
    if rest:
        return (
            f"a {nbytes}-byte object is not a whole number of {token_bytes}-byte tokens "
            f"(remote_serde must be 'naive')"
        )
    if tokens == 0:
        return "an empty object"
    if tokens > chunk_tokens:
        return (
            f"a {nbytes}-byte object holds {tokens} tokens, more than one "
            f"{chunk_tokens}-token chunk (the chunk size LMCache gave the plugin)"
        )
    return None


class KVFabricRemoteConnector(RemoteConnector):
    """LMCache chunks in the node daemon's tiers, through its shared pages."""

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
        plugin_name: str = PLUGIN_TYPE,
    ) -> None:
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = plugin_name
        self.settings = PluginSettings.from_extra_config(config.extra_config, plugin_name)
        self.token_bytes = self.single_token_size
        self.chunk_tokens = self.full_chunk_size_bytes // self.token_bytes
        self.spec = opaque_spec(self.token_bytes, self.chunk_tokens)
        self.namespace = namespace_for(
            metadata.model_name,
            self.spec,
            model_id=self.settings.model_id,
            tenant=self.settings.tenant,
            lora_id=self.settings.lora_id,
        )
        self._layout = layout_tag(self.meta_fmt, self.meta_shapes, self.meta_dtypes)
        self._link = DaemonLink(
            self.settings.socket_path,
            self.settings.token,
            timeout=self.settings.timeout_s,
            engine="lmcache",
            retry_after_s=self.settings.retry_after_s,
        )
        self._pull = self.settings.pull
        self._executor = ThreadPoolExecutor(
            self.settings.threads, thread_name_prefix="kvfabric-lmcache"
        )
        self._stats = Counters[int](COUNTERS)  # monotonic
        self._closed = False
        _LIVE.add(self)
        log.info(
            "kvfabric LMCache plugin %r: daemon %s, namespace model %r tenant %r, "
            "%d-byte tokens, %d-token chunks",
            plugin_name,
            self.settings.socket_path,
            self.namespace.model_id,
            self.namespace.tenant_salt,
            self.token_bytes,
            self.chunk_tokens,
        )

    # ------------------------------------------------------------------ keys, stats

    def kvfabric_key(self, key: CacheEngineKey) -> bytes:
        return chunk_key(self.namespace, self._layout, key.to_string())

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()

    # ------------------------------------------------------------------ LMCache API

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._offload(self._prefix_hits, [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._prefix_hits([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._prefix_hits(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self._offload(self._prefix_hits, keys)

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self._offload(self._get_many, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._offload(self._get_many, keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        """The consecutive hits from the first key; objects after a miss are given back."""
        objs = await self._offload(self._get_many, keys)
        out: list[MemoryObj] = []
        missed = False
        for obj in objs:
            missed = missed or obj is None
            if not missed:
                out.append(obj)
            elif obj is not None:
                obj.ref_count_down()
        return out

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._offload(self._put_many, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(
        self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]
    ) -> None:
        await self._offload(self._put_many, list(keys), list(memory_objs))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return bool(self._call(lambda c: c.delete(self.namespace, self.kvfabric_key(key)), False))

    async def list(self) -> list[str]:
        """kvfabric keys are one-way hashes: the LMCache keys cannot be listed."""
        return []

    async def close(self) -> None:
        self.close_sync()

    def close_sync(self) -> None:
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._link.close()
            _LIVE.discard(self)

    def __repr__(self) -> str:
        return f"<KVFabricRemoteConnector {self.plugin_name} at {self.settings.socket_path}>"

    # ------------------------------------------------------------------ blocking work

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _call(self, fn: Callable[[Client], T], fallback: T) -> T:
        """``fn(client)``; a daemon that is down or fails is a miss (``fallback``)."""
        try:
            client = self._link.client()
        except UnavailableError:
            return fallback
        try:
            return fn(client)
        except (OSError, UnavailableError) as exc:
            self._link.failed(exc)
            return fallback
        except KVFabricError as exc:
            self._stats.add(errors=1)
            log.warning("kvfabric plugin %s: %s", self.plugin_name, exc)
            return fallback

    def _prefix_hits(self, keys: Sequence[CacheEngineKey]) -> int:
        """Consecutive keys held from the first (pulling missing ones when clustered)."""
        if not keys:
            return 0
        fkeys = [self.kvfabric_key(k) for k in keys]

        def lookup(client: Client) -> int:
            hit, elsewhere = self._lookup(client, fkeys)
            if elsewhere > hit and self._pull_missing(client, fkeys[hit:elsewhere]):
                # a check, not a second lookup: the daemon counted the first one (tokens
                # other nodes held as hits from "peer")
                hit = held_prefix(client.contains(self.namespace, fkeys))
            return hit

        hits = self._call(lookup, 0)
        self._stats.add(lookups=1, lookup_keys=len(keys), lookup_hits=hits)
        return hits

    def _lookup(self, client: Client, fkeys: builtins.list[bytes]) -> tuple[int, int]:
        """(chunks held here, the longest prefix any node holds: as many while not
        pulling)."""
        if self._pull:
            try:
                result = client.lookup(self.namespace, keys=fkeys, scope="cluster")
                return result.matched_chunks, result.cluster_chunks or 0
            except UnsupportedError:  # no global index: nothing to pull from
                log.info(
                    "kvfabric plugin %s: the daemon is not in a cluster; not pulling",
                    self.plugin_name,
                )
                self._pull = False
        hit = client.lookup(self.namespace, keys=fkeys).matched_chunks
        return hit, hit

    def _pull_missing(self, client: Client, fkeys: builtins.list[bytes]) -> int:
        """Have the daemon pull ``fkeys`` from the nodes holding them; chunks pulled."""
        try:
            reply = client.prefetch(
                self.namespace, keys=fkeys, timeout=self.settings.pull_timeout_s
            )
        except UnsupportedError:
            log.info(
                "kvfabric plugin %s: the daemon is not in a cluster; not pulling", self.plugin_name
            )
            self._pull = False
            return 0
        pulled = int(reply.get("pulled", 0))
        self._stats.add(pulls=1, pulled_chunks=pulled)
        return pulled

    def _get_many(self, keys: Sequence[CacheEngineKey]) -> builtins.list[MemoryObj | None]:
        fkeys = [self.kvfabric_key(k) for k in keys]
        out: builtins.list[MemoryObj | None] = [None] * len(keys)

        def read(client: Client) -> None:
            try:
                readers = client.get_many(self.namespace, fkeys)
            except UnavailableError:
                raise
            except KVFabricError as exc:  # e.g. no room to bring them all up at once
                log.info(
                    "kvfabric plugin %s: batch get failed (%s); one by one", self.plugin_name, exc
                )
                for i, fkey in enumerate(fkeys):
                    out[i] = self._get_one(client, fkey)
                return
            missing = [i for i, r in enumerate(readers) if r is None]
            if missing and self._pull and self._pull_missing(client, [fkeys[i] for i in missing]):
                again = client.get_many(self.namespace, [fkeys[i] for i in missing])
                for i, reader in zip(missing, again):
                    readers[i] = reader
            try:
                for i, reader in enumerate(readers):
                    if reader is not None:
                        out[i] = self._read_into_new_obj(reader)
            finally:
                client.release_many(readers)

        try:
            self._call(read, None)
        except BaseException:
            for i, obj in enumerate(out):
                if obj is not None:
                    obj.ref_count_down()
                    out[i] = None
            raise
        hits = sum(obj is not None for obj in out)
        self._stats.add(
            gets=len(keys),
            get_hits=hits,
            get_misses=len(keys) - hits,
            bytes_read=sum(obj.get_size() for obj in out if obj is not None),
        )
        return out

    def _get_one(self, client: Client, fkey: bytes) -> MemoryObj | None:
        try:
            with client.get(self.namespace, fkey) as reader:
                return self._read_into_new_obj(reader)
        except NotFoundError:
            return None
        except UnavailableError:
            raise
        except KVFabricError as exc:
            self._stats.add(errors=1)
            log.warning("kvfabric plugin %s: get failed: %s", self.plugin_name, exc)
            return None

    def _read_into_new_obj(self, reader: RemoteReader) -> MemoryObj | None:
        """Copy a pinned chunk straight into a memory object from LMCache's allocator."""
        if not reader.complete:
            reader.wait_complete(timeout=self.settings.timeout_s)
        nbytes = reader.nbytes
        obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if obj is None:
            log.warning(
                "kvfabric plugin %s: LMCache's CPU buffer is full; a hit is dropped",
                self.plugin_name,
            )
            self._stats.add(errors=1)
            return None
        try:
            dst = np.frombuffer(obj.byte_array, dtype=np.uint8)
            reader.read_into(dst[:nbytes])
            if nbytes != self.full_chunk_size_bytes:
                obj = self.reshape_partial_chunk(obj, nbytes)
        except BaseException:
            obj.ref_count_down()
            raise
        return obj

    def _put_many(
        self, keys: builtins.list[CacheEngineKey], objs: builtins.list[MemoryObj]
    ) -> None:
        if len(keys) != len(objs):
            raise ValueError("one memory object per key")
        chunks: builtins.list[ChunkRef] = []
        sources: builtins.list[np.ndarray] = []
        for key, obj in zip(keys, objs):
            src = np.frombuffer(obj.byte_array, dtype=np.uint8)
            problem = unstorable(src.nbytes, self.token_bytes, self.chunk_tokens)
            if problem is not None:
                self._stats.add(put_failed=1, errors=1)
                log.warning("kvfabric plugin %s: %s; not stored", self.plugin_name, problem)
                continue
            chunks.append(ChunkRef(self.kvfabric_key(key), ROOT, src.nbytes // self.token_bytes))
            sources.append(src)
        if not chunks:
            return

        def write(client: Client) -> tuple[int, int, int, int]:
            # no token ids: LMCache's put has none, and its keys are not kvfabric's chained
            # hashes of tokens that the daemon would check them with
            results = client.reserve_many(self.namespace, chunks)
            writers: builtins.list[RemoteWriter] = []
            existing = failed = written = 0
            try:
                for result, src in zip(results, sources):
                    if isinstance(result, RemoteWriter):
                        result.write(src)
                        writers.append(result)
                    elif isinstance(result, AlreadyExistsError):
                        existing += 1
                    else:
                        failed += 1
                        log.warning("kvfabric plugin %s: put refused: %s", self.plugin_name, result)
            except BaseException:
                for writer in (r for r in results if isinstance(r, RemoteWriter)):
                    writer.abort()
                raise
            client.commit_many(writers)
            written = sum(
                src.nbytes
                for result, src in zip(results, sources)
                if isinstance(result, RemoteWriter)
            )
            return len(writers), existing, failed, written

        stored, existing, failed, written = self._call(write, (0, 0, len(chunks), 0))
        self._stats.add(
            puts=len(keys),
            put_stored=stored,
            put_existing=existing,
            put_failed=failed + len(keys) - len(chunks),
            bytes_written=written,
        )


_register_collector()


class KVFabricConnectorAdapter(ConnectorAdapter):
    """Creates the connector for ``plugin://kvfabric`` (or ``plugin://kvfabric.<instance>``)."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        return (
            url.startswith("plugin://")
            and extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE
        )

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        config = context.config
        if config is None:
            raise ValueError("the kvfabric plugin needs LMCache's engine config")
        serde = getattr(config, "remote_serde", "naive")
        if serde not in (None, "naive"):
            raise ValueError(
                f"the kvfabric plugin stores raw chunks: set remote_serde to "
                f"'naive' (got {serde!r})"
            )
        metadata = context.metadata or getattr(context.local_cpu_backend, "metadata", None)
        plugin_name = context.plugin_name or context.url[len("plugin://") :]
        return KVFabricRemoteConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=config,
            metadata=metadata,
            plugin_name=plugin_name,
        )
