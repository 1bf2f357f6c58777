"""kvfabric as an SGLang HiCache storage backend (the L3 tier under HiCache's host pool).

SGLang creates the backend through its storage factory (``--hicache-storage-backend
dynamic``), calls ``register_mem_pool_host`` with its host KV pool, then calls the storage
methods from its prefetch, hit-query and backup threads, concurrently:

- ``batch_exists(keys)``: how many pages, counted from the first key, the fabric holds. With
  ``pull`` (default) a node that holds fewer than the cluster asks its daemon to pull the
  rest from their owners first, so the loads that follow are local.
- ``batch_get_v1`` / ``batch_set_v1`` (``interface_v1: 1``, zero copy): pages move straight
  between SGLang's host pool and the daemon's shared pages, addressed by ``host_indices``
  (``page_size`` token slots per key, the page starting at the first).
- ``get`` / ``batch_get`` / ``set`` / ``batch_set`` (SGLang's copying interface): the same,
  from and into flat pages (``get_data_page`` / ``get_dummy_flat_data_page``).
- ``exists``, ``clear`` (deletes the pages this backend stored; pages other engines stored
  stay: the fabric is shared), ``get_stats`` (:class:`~.stats.KVFabricStorageMetrics`).

Pages of both paths are stored in kvfabric's canonical layout (see :mod:`.layout`), in the
namespace of :mod:`.keys`. Nothing here raises into SGLang for a storage failure: a missing,
restarting or failing daemon makes every call a miss (``None`` / ``False`` / ``0``), logged
and counted, and the engine recomputes. Configuration errors (unknown settings, an
unsupported host layout) raise ``ValueError`` (``TypeError`` for a setting of the wrong
type) at creation / registration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvfabric.client import Client
from kvfabric.client.objects import RemoteWriter
from kvfabric.errors import AlreadyExistsError, KVFabricError, UnavailableError, UnsupportedError
from kvfabric.hashing import ChunkRef
from kvfabric.spec import Namespace
from kvfabric_connectors.link import DaemonLink, held_prefix

from .keys import namespace_for, page_chunks, page_key
from .layout import PageLayout, read_chunk, write_chunk
from .settings import StorageSettings
from .stats import KVFabricStorageMetrics, StorageCounters

log = logging.getLogger(__name__)

# clear() deletes the pages this backend stored; it remembers this many of the latest
# (older ones age out of the fabric through its own eviction).
CLEAR_MEMORY_PAGES = 1 << 18


class KVFabricHiCacheStorage(HiCacheStorage):
    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        self.settings = StorageSettings.from_extra_config(storage_config.extra_config)
        model_id = self.settings.model_id or storage_config.model_name
        if not model_id:
            raise ValueError(
                "kvfabric HiCache storage needs a model id: SGLang's model_name "
                "or the extra config's model_id"
            )
        self.model_id = str(model_id)
        # SGLang calls from its prefetch, hit-query and backup threads at once
        self._link = DaemonLink(
            self.settings.socket_path,
            self.settings.token,
            timeout=self.settings.timeout_s,
            engine="sglang",
            per_thread=True,
        )
        self.counters = StorageCounters()
        self._cluster = self.settings.pull  # until the daemon says it has no global index
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._stored_lock = threading.Lock()
        self._layout: PageLayout | None = None
        self._ns: Namespace | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called by SGLang right after creation with its host KV pool."""
        super().register_mem_pool_host(mem_pool_host)
        self._layout = PageLayout.of_pool(mem_pool_host, self.storage_config.is_mla_model)
        self._ns = namespace_for(
            self.model_id, self.storage_config, self._layout.spec, self.settings.cache_salt
        )

    @property
    def namespace(self) -> Namespace:
        self._check_registered()
        assert self._ns is not None
        return self._ns

    # -- queries ---------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Pages held from the first key on (pulling what only other nodes hold)."""
        if not keys:
            return 0
        chunk_keys = [page_key(k) for k in keys]
        deadline = time.monotonic() + self.settings.timeout_s
        hit = 0
        try:
            client = self._link.client()
            hit, cluster = self._lookup(client, chunk_keys)
            if cluster > hit:
                reply = client.prefetch(
                    self.namespace, keys=chunk_keys[:cluster], timeout=_left(deadline)
                )
                self.counters.add(pulled_pages=int(reply.get("pulled", 0)))
                # a check, not a second lookup: the daemon counted the first one (pages other
                # nodes held as hits from "peer")
                hit = held_prefix(client.contains(self.namespace, chunk_keys))
        except (KVFabricError, OSError) as exc:
            self._failed("exists", exc)
        self.counters.add(queried_pages=len(keys), hit_pages=hit)
        return hit

    def _lookup(self, client: Client, chunk_keys: list[bytes]) -> tuple[int, int]:
        """(pages this node holds, pages the longest-holding node holds)."""
        if self._cluster:
            try:
                result = client.lookup(self.namespace, keys=chunk_keys, scope="cluster")
                return result.matched_chunks, result.cluster_chunks or 0
            except UnsupportedError:
                self._cluster = False  # a single node: local lookups say it all
        result = client.lookup(self.namespace, keys=chunk_keys)
        return result.matched_chunks, result.matched_chunks

    # -- zero copy (interface_v1) ----------------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages straight into the host pool at ``host_indices``."""
        pages = self._pool_pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        return self._load([page_key(k) for k in keys], pages)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store pages straight from the host pool at ``host_indices``."""
        pages = self._pool_pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self._store(page_chunks(keys, prefix, self._page_tokens), pages)

    def _pool_pages(
        self, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[torch.Tensor] | None:
        """Canonical views of the pool pages that ``host_indices`` addresses, one per key."""
        self._check_registered()
        assert self._layout is not None
        tokens = self._page_tokens
        if host_indices.numel() != len(keys) * tokens:
            log.error(
                "kvfabric HiCache: %d host indices for %d pages of %d tokens",
                host_indices.numel(),
                len(keys),
                tokens,
            )
            return None
        starts = host_indices[::tokens].tolist()
        return [
            self._layout.canonical(self.mem_pool_host.get_data_page(start, flat=False))
            for start in starts
        ]

    # -- copying interface -----------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Load pages into flat pages (``target_locations``, allocated when not given)."""
        self._check_registered()
        given = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets: list[torch.Tensor] = [
            t if t is not None else self.mem_pool_host.get_dummy_flat_data_page() for t in given
        ]
        assert self._layout is not None
        done = self._load([page_key(k) for k in keys], [self._layout.canonical(t) for t in targets])
        return [t if ok else None for t, ok in zip(targets, done)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one flat page: ``value``, or a ``target_location`` tensor (the spelling
        ``get`` takes); True once the page is held, False otherwise (a location that is no
        page tensor, such as another backend's raw address, included)."""
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (``get_data_page``: ``values``, or ``target_locations`` when
        there are none); True if every page is now held, False otherwise: never raises for
        pages it cannot take (missing, not tensors of the pool's page, a count that does
        not match the keys)."""
        self._check_registered()
        assert self._layout is not None
        if values is None:
            values = target_locations
        if values is None or len(values) != len(keys):
            log.error("kvfabric HiCache: batch_set needs one page per key")
            self.counters.add(write_failures=len(keys))
            return False
        try:
            pages = [self._layout.canonical(_page_tensor(v)) for v in values]
        except (TypeError, ValueError, RuntimeError) as exc:
            log.error(
                "kvfabric HiCache: batch_set takes flat pages of the host pool "
                "(get_data_page), not these: %s",
                exc,
            )
            self.counters.add(write_failures=len(keys))
            return False
        return all(self._store(page_chunks(keys, None, self._page_tokens), pages))

    # -- data movement ---------------------------------------------------------------------

    def _load(self, chunk_keys: list[bytes], pages: list[torch.Tensor]) -> list[bool]:
        if not chunk_keys:
            return []
        started = time.perf_counter()
        deadline = time.monotonic() + self.settings.timeout_s
        done = [False] * len(chunk_keys)
        try:
            client = self._link.client()
            readers = client.get_many(self.namespace, chunk_keys, timeout=_left(deadline))
            try:
                for i, (reader, page) in enumerate(zip(readers, pages)):
                    if reader is None:
                        continue
                    try:
                        read_chunk(reader, page, _left(deadline))
                        done[i] = True
                    except KVFabricError as exc:
                        log.warning(
                            "kvfabric HiCache: page %s not loaded: %s", chunk_keys[i].hex(), exc
                        )
            finally:
                # a pin that ran out before its release may have had its pages reused
                # under the copy: the whole batch is suspect then
                client.release_many(readers)
        except (KVFabricError, OSError) as exc:
            self._failed("get", exc)
            done = [False] * len(chunk_keys)
        loaded = sum(done)
        nbytes = loaded * self.namespace.spec.chunk_bytes
        self.counters.add(
            read_pages=loaded, read_bytes=nbytes, read_misses=len(chunk_keys) - loaded
        )
        self.counters.read_batch(loaded, nbytes, time.perf_counter() - started)
        return done

    def _store(self, chunks: list[ChunkRef], pages: list[torch.Tensor]) -> list[bool]:
        if not chunks:
            return []
        started = time.perf_counter()
        done = [False] * len(chunks)
        written: list[tuple[int, RemoteWriter]] = []
        results: list[Any] = []
        try:
            client = self._link.client()
            # no token ids: SGLang does not pass them to set, and its page keys are its own
            # hashes, not kvfabric's chained hashes of tokens that the daemon checks them with
            results = client.reserve_many(self.namespace, chunks)
            for i, (result, page) in enumerate(zip(results, pages)):
                if isinstance(result, AlreadyExistsError):
                    done[i] = True  # held already (another rank, engine or earlier set)
                elif isinstance(result, RemoteWriter):
                    try:
                        write_chunk(result, page)
                        written.append((i, result))
                    except KVFabricError as exc:
                        result.abort()
                        log.warning(
                            "kvfabric HiCache: page %s not stored: %s", chunks[i].key.hex(), exc
                        )
                else:
                    log.warning(
                        "kvfabric HiCache: page %s not stored: %s", chunks[i].key.hex(), result
                    )
            client.commit_many([writer for _, writer in written])
        except (KVFabricError, OSError) as exc:
            self._failed("set", exc)
            return [False] * len(chunks)
        except BaseException:
            for result in results:  # give the reservations back before SGLang sees the bug
                if isinstance(result, RemoteWriter) and not result.closed:
                    result.abort()
            raise
        for i, _ in written:
            done[i] = True
        self._remember(writer.key for _, writer in written)
        nbytes = len(written) * self.namespace.spec.chunk_bytes
        self.counters.add(
            written_pages=len(written),
            written_bytes=nbytes,
            already_stored_pages=sum(done) - len(written),
            write_failures=len(chunks) - sum(done),
        )
        self.counters.write_batch(len(written), nbytes, time.perf_counter() - started)
        return done

    # -- housekeeping ----------------------------------------------------------------------

    def clear(self) -> None:
        """Delete the pages this backend stored (the latest ``CLEAR_MEMORY_PAGES``)."""
        with self._stored_lock:
            keys, self._stored = list(self._stored), OrderedDict()
        if not keys or self._ns is None:
            return
        try:
            client = self._link.client()
            for key in keys:
                client.delete(self._ns, key)
        except (KVFabricError, OSError) as exc:
            self._failed("clear", exc)

    def get_stats(self) -> KVFabricStorageMetrics:
        return self.counters.take()

    def close(self) -> None:
        self._link.close()

    def _remember(self, keys: Any) -> None:
        with self._stored_lock:
            for key in keys:
                self._stored[key] = None
                self._stored.move_to_end(key)
            while len(self._stored) > CLEAR_MEMORY_PAGES:
                self._stored.popitem(last=False)

    @property
    def _page_tokens(self) -> int:
        assert self._layout is not None
        return self._layout.page_tokens

    def _check_registered(self) -> None:
        if self._layout is None:
            raise RuntimeError("register_mem_pool_host must be called before storage calls")

    def _failed(self, what: str, exc: BaseException) -> None:
        self._link.failed(exc)
        self.counters.add(daemon_errors=1)
        if not isinstance(exc, UnavailableError):
            log.warning("kvfabric HiCache %s failed: %s", what, exc)


def _page_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a page must be a tensor, got {type(value).__name__}")
    return value


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
