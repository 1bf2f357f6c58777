"""The daemon's link to the global prefix index: publishes the node's inventory, answers
cluster-wide lookups.

:class:`ClusterLink` owns one :class:`~kvfabric.cluster.index.GlobalIndex` client built from
:class:`~kvfabric.config.ClusterConfig` ("embedded": an in-process index of this node alone;
"redis": the shared index). At start it registers the node (a new epoch) and subscribes to the
store's inventory changes, replaying the current inventory (objects recovered from SSD) as
the first publish; every later change is queued for the index's batching flusher from under
the store lock, so the store's hot path never waits on the network. A heartbeat thread renews
the lease, and registers the node late if the index was unreachable at start.

Stored chunks go to the index with their token ids (the event stream carries them; another
node's KV event stream announces them from there, :mod:`kvfabric.kvevents.remote`) for the
namespaces ``publishes_tokens`` names: token ids are prompts, so by default those without a
tenant salt only (the daemon passes its ``kv_events.tenants`` rule).

Outages: the Redis client republishes the whole inventory by itself once the server is back
(it is given :meth:`ClusterLink._records` as its ``inventory`` callback). Meanwhile
:meth:`ClusterLink.lookup` answers from the local store with ``stale=True``: it never raises
because the index is down and never waits longer than the client's socket timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from kvfabric.cluster import EmbeddedIndex, EmbeddedState
from kvfabric.cluster.index import (
    ChunkRecord,
    GlobalIndex,
    GlobalLookup,
    Location,
    NodeInfo,
    NodePrefixRow,
    check_name,
)
from kvfabric.config import ClusterConfig
from kvfabric.errors import (
    ConfigError,
    DuplicateNodeError,
    KVFabricError,
    LeaseExpiredError,
    NotFoundError,
    SpecError,
    SpecMismatchError,
    UnavailableError,
)
from kvfabric.spec import Namespace
from kvfabric.store.protocol import RemovedObject, Store, StoredObject

log = logging.getLogger(__name__)

NODE_CLASSES_CACHE_S = 2.0


class ClusterLink:
    """One node's membership of the global index (see the module docstring).

    Thread-safe. :meth:`close` is idempotent; after it, store changes are no longer published.
    Raises :class:`~kvfabric.errors.ConfigError` when the node id or a tier name cannot be
    used in the index (they must be 1-128 characters of ``[A-Za-z0-9_.:-]``).
    """

    def __init__(
        self,
        config: ClusterConfig,
        node_id: str,
        address: str,
        store: Store,
        transports: dict[str, str] | None = None,
        publishes_tokens: Callable[[Namespace], bool] = lambda ns: not ns.tenant_salt,
    ) -> None:
        """``transports``: backend name -> descriptor (hex) peers pull this node's chunks
        with; published with the node's registration. ``publishes_tokens``: whether a
        namespace's token ids go to the index (see the module docstring)."""
        try:
            check_name("node_id", node_id)
            self._info = NodeInfo(
                node_id,
                address,
                tuple(store.tier_names),
                config.hardware_class,
                dict(transports or {}),
            )
        except SpecError as exc:
            raise ConfigError(f"cannot join the global index: {exc}") from None
        self._config = config
        self._store = store
        self._publishes_tokens = publishes_tokens
        self._index = self._build_index()
        self._epoch = 0  # the epoch this link last registered; 0: not registered yet
        self._closed = threading.Event()
        self._unavailable_logged = False
        # whether the last register or heartbeat reached the index (kvfabric_cluster_index_up)
        self._reachable = True
        self._classes_lock = threading.Lock()
        self._classes: tuple[float, dict[str, str]] = (0.0, {})  # (good until, classes)
        self._try_register()
        # Replayed under the store lock with the subscription: nothing is missed or reordered.
        store.add_inventory_listener(self._on_inventory, replay=True)
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, daemon=True, name="kvfabric-cluster-heartbeat"
        )
        self._heartbeat.start()

    def _build_index(self) -> GlobalIndex:
        config = self._config
        if config.index == "embedded":
            return EmbeddedIndex(EmbeddedState(lease_ttl=config.lease_ttl_s))
        from kvfabric.cluster.redis_index import RedisGlobalIndex  # redis-py is optional

        assert config.redis_url is not None  # ClusterConfig guarantees it for "redis"
        return RedisGlobalIndex(
            config.redis_url, lease_ttl=config.lease_ttl_s, inventory=self._records
        )

    @property
    def node_id(self) -> str:
        return self._info.node_id

    @property
    def index(self) -> GlobalIndex:
        """The underlying index client (events, snapshot, nodes)."""
        return self._index

    # -- membership -------------------------------------------------------------------
    def _try_register(self) -> bool:
        """Join the index; DuplicateNodeError when another live daemon uses this node id
        (its lease renewed while we watched it for up to three heartbeats)."""
        config = self._config
        try:
            self._epoch = self._index.register(
                self._info, takeover_after_s=min(config.lease_ttl_s, 3 * config.heartbeat_s)
            ).epoch
        except UnavailableError as exc:
            self._log_unavailable(exc)
            return False
        self._unavailable_logged, self._reachable = False, True
        log.info(
            "node %s joined the global index (%s) as epoch %d",
            self.node_id,
            self._describe(),
            self._epoch,
        )
        return True

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self._config.heartbeat_s):
            try:
                if not self._epoch:
                    # Unreachable at start: join now. The failed attempt left the client
                    # stale, so its flusher republishes the whole inventory by itself.
                    self._try_register()
                    continue
                self._index.heartbeat()
                self._unavailable_logged, self._reachable = False, True
            except UnavailableError as exc:
                self._log_unavailable(exc)
            except LeaseExpiredError as exc:
                # another process registered this node id: two daemons share a node_id
                self._reachable = True  # the index answered
                log.error("global index: %s; is node_id %r used twice?", exc, self.node_id)
            except DuplicateNodeError as exc:  # a late join found the id taken: retried
                self._reachable = True
                log.error("cannot join the global index: %s", exc)
            except KVFabricError:
                log.exception("global index heartbeat failed")

    def _log_unavailable(self, exc: UnavailableError) -> None:
        self._reachable = False
        if not self._unavailable_logged:  # once per outage, not once per heartbeat
            self._unavailable_logged = True
            log.warning(
                "global index (%s) unavailable, serving local hits only: %s", self._describe(), exc
            )

    def _describe(self) -> str:
        config = self._config
        return "embedded" if config.index == "embedded" else config.redis_url_redacted

    # -- inventory --------------------------------------------------------------------
    def _on_inventory(self, stored: list[StoredObject], removed: list[RemovedObject]) -> None:
        """Store listener (under the store lock): translate and queue, nothing more."""
        if self._closed.is_set():
            return
        try:
            self._index.publish(
                stored=[self._record(obj) for obj in stored],
                removed=[ChunkRecord(ns.seed, key, tier) for ns, key, tier in removed],
            )
        except UnavailableError:
            pass  # closed concurrently: the node's next start republishes everything

    def _records(self) -> Iterator[ChunkRecord]:
        """The whole local inventory as index records (for a republish)."""
        for obj in self._store.inventory():
            yield self._record(obj)

    def _record(self, obj: StoredObject) -> ChunkRecord:
        ns = obj.ns
        tokens = obj.tokens if self._publishes_tokens(ns) else None
        return ChunkRecord(
            ns.seed,
            obj.key,
            obj.tier,
            obj.parent,
            obj.num_tokens,
            tokens,
            ns.spec.chunk_tokens,
            ns.lora_id,
        )

    # -- reads ------------------------------------------------------------------------
    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> GlobalLookup:
        """Longest prefix of the chain ``keys`` held by live nodes, with every owner.

        If the index cannot be reached, the answer is this node's own copies (from the local
        store) with ``stale=True``. Bad keys raise SpecError.
        """
        try:
            return self._index.lookup(ns.seed, keys)
        except UnavailableError:
            return self._local_lookup(ns, keys)

    def node_prefixes(
        self, ns: Namespace, keys: Sequence[bytes]
    ) -> tuple[list[NodePrefixRow], bool]:
        """What a router weighs, per live node holding a prefix of ``keys``: its epoch,
        declared hardware class, leading chunks held and those per tier; and whether the
        answer is stale (see :meth:`lookup`)."""
        found = self.lookup(ns, keys)
        classes = self.hardware_classes()
        return [
            {
                "node_id": p.node_id,
                "epoch": p.epoch,
                "chunks": p.chunks,
                "tier_chunks": dict(p.tier_chunks),
                "hardware_class": classes.get(p.node_id, ""),
            }
            for p in found.nodes().values()
        ], found.stale

    def hardware_classes(self) -> dict[str, str]:
        """Live node id -> hardware class (the node registry), re-read from the index at most every
        :data:`NODE_CLASSES_CACHE_S` (classes change only when nodes (re)join)."""
        now = time.monotonic()
        with self._classes_lock:
            if now < self._classes[0]:
                return self._classes[1]
        try:
            classes = {n.node_id: n.hardware_class for n in self._index.nodes()}
        except UnavailableError:
            classes = {self.node_id: self._info.hardware_class}
        with self._classes_lock:
            self._classes = (now + NODE_CLASSES_CACHE_S, classes)
        return classes

    def _local_lookup(self, ns: Namespace, keys: Sequence[bytes]) -> GlobalLookup:
        # tier_of, not store.lookup: the caller has counted this lookup in the stats already
        owners: list[tuple[Location, ...]] = []
        for key in keys:
            try:
                tier = self._store.tier_of(ns, key)
            except (NotFoundError, SpecMismatchError):
                break  # the local prefix ends here
            owners.append((Location(self.node_id, self._epoch, tier),))
        return GlobalLookup(len(keys), tuple(owners), stale=True)

    @property
    def reachable(self) -> bool:
        """Whether the last register or heartbeat (every ``heartbeat_s``) reached the index;
        always True for the embedded one."""
        return self._reachable

    @property
    def stale(self) -> bool:
        """True while this node's published inventory may lag (index lost, not republished)."""
        return self._index.stale

    def close(self) -> None:
        """Stop the heartbeat, send what is queued (best effort) and disconnect."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._heartbeat.join()
        self._index.close()
