"""Prometheus metrics of one kvfabric daemon: every definition, and the text exposition.

:class:`Metrics` owns a private :class:`~prometheus_client.CollectorRegistry` (never the
process-global one, so several daemons or tests can live in one process). Two kinds of
series live in it:

* **Event metrics**, pushed by their callers as things happen: the control server calls
  :meth:`Metrics.session_opened` / :meth:`~Metrics.session_closed` /
  :meth:`~Metrics.observe_request` / :meth:`~Metrics.control_connection_closed` /
  :meth:`~Metrics.control_pending`; the HTTP API calls :meth:`~Metrics.observe_request` with
  ``plane="http"``; :class:`~kvfabric.server.instrumented.InstrumentedStore` calls
  :meth:`~Metrics.observe_store_op` and :meth:`~Metrics.count_lookup` (tokens, per tier and
  per tenant; tier ``peer``: held by another node), and
  :class:`~kvfabric.server.instrumented.InstrumentedPuller` :meth:`~Metrics.count_pull`.
* **Store metrics**, read from ``store.stats()`` at scrape time by a custom collector (tier
  capacity / usage gauges and the store's own counters), so the store keeps no Prometheus
  code and a scrape always sees one consistent snapshot.

Every metric is named ``kvfabric_*`` (counters ``*_total``) and documented in
``docs/metrics.md``. Tenant label values are capped at ``max_tenants`` distinct values per
daemon; later tenants are counted under :data:`OTHER_TENANT`, so a deployment that uses a
cache salt per end user cannot blow up the series count.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfabric.errors import KVFabricError
from kvfabric.store.stats import StoreStats

log = logging.getLogger(__name__)

PREFIX = "kvfabric_"
DEFAULT_MAX_TENANTS = 256
OTHER_TENANT = "__other__"
# Store operations range from ~10 us (an in-memory lookup) to seconds (an SSD read-back
# under load, a layer wait); requests add the socket round trip.
FRACTION_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 1.0)
LATENCY_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

M = TypeVar("M", bound=MetricWrapperBase)


def error_kind(exc: BaseException) -> str:
    """The stable label of an error: a kvfabric error's ``kind``, else ``internal``."""
    return exc.kind if isinstance(exc, KVFabricError) else "internal"


class StatsSource(Protocol):
    def stats(self) -> StoreStats: ...


class Metrics:
    """All metrics of one daemon, in a registry of its own."""

    def __init__(
        self, store: StatsSource | None = None, *, max_tenants: int = DEFAULT_MAX_TENANTS
    ) -> None:
        if max_tenants < 1:
            raise ValueError("max_tenants must be at least 1")
        self.registry = CollectorRegistry(auto_describe=True)  # catches duplicate names
        reg = self.registry
        self._sessions = Gauge(f"{PREFIX}sessions", "Open control-plane sessions.", registry=reg)
        self._lookups = _Children(
            Counter(
                f"{PREFIX}lookups", "Prefix lookups served by the store.", ["tenant"], registry=reg
            )
        )
        self._lookup_tokens = _Children(
            Counter(
                f"{PREFIX}lookup_tokens",
                "Tokens asked for by prefix lookups (a partial last "
                "chunk by its real tokens when the caller gave them, else full chunks).",
                ["tenant"],
                registry=reg,
            )
        )
        self._hit_tokens = _Children(
            Counter(
                f"{PREFIX}hit_tokens",
                "Looked-up tokens found, by the tier that held them "
                "(peer: past this node's prefix, held by another node; cluster-scope lookups).",
                ["tier", "tenant"],
                registry=reg,
            )
        )
        self._miss_tokens = _Children(
            Counter(
                f"{PREFIX}miss_tokens",
                "Looked-up tokens found neither here nor (cluster-scope lookups) on another node.",
                ["tenant"],
                registry=reg,
            )
        )
        self._store_seconds = _Children(
            Histogram(
                f"{PREFIX}store_operation_duration_seconds",
                "Latency of store operations.",
                ["op"],
                buckets=LATENCY_BUCKETS,
                registry=reg,
            )
        )
        self._store_errors = _Children(
            Counter(
                f"{PREFIX}store_errors",
                "Store operations that raised, by error kind.",
                ["op", "kind"],
                registry=reg,
            )
        )
        self._request_seconds = _Children(
            Histogram(
                f"{PREFIX}request_duration_seconds",
                "Latency of control (socket) and HTTP API requests, errors included.",
                ["plane", "op"],
                buckets=LATENCY_BUCKETS,
                registry=reg,
            )
        )
        self._request_errors = _Children(
            Counter(
                f"{PREFIX}request_errors",
                "Requests answered with an error, by error kind.",
                ["plane", "op", "kind"],
                registry=reg,
            )
        )
        self._engine_lookup_tokens = _Children(
            Counter(
                f"{PREFIX}engine_lookup_tokens",
                "Tokens looked up, by the engine that asked.",
                ["engine"],
                registry=reg,
            )
        )
        self._engine_hit_tokens = _Children(
            Counter(
                f"{PREFIX}engine_hit_tokens",
                "Looked-up tokens found, by the engine that asked.",
                ["engine"],
                registry=reg,
            )
        )
        self._engine_bytes = _Children(
            Counter(
                f"{PREFIX}engine_bytes",
                "KV payload bytes pinned for reading (read) or reserved "
                "for writing (written), by engine.",
                ["engine", "direction"],
                registry=reg,
            )
        )
        self._conversions = _Children(
            Counter(
                f"{PREFIX}read_conversions",
                "Chunks pinned for a read that converts them, by "
                "engine and conversion (dtype, heads, layout).",
                ["engine", "conversion"],
                registry=reg,
            )
        )
        self._node_info = _Children(
            Gauge(
                f"{PREFIX}node_info",
                "This node's id and declared hardware class (always 1).",
                ["node_id", "hardware_class"],
                registry=reg,
            )
        )
        self._push_chunks = _Children(
            Counter(
                f"{PREFIX}push_chunks",
                "Chunks this node pushed, by the target's hardware class "
                "and outcome (pushed, already_there, failed).",
                ["target_class", "outcome"],
                registry=reg,
            )
        )
        self._push_bytes = _Children(
            Counter(
                f"{PREFIX}push_bytes",
                "Bytes this node's pushes moved, by the target's hardware class and form: "
                "wire (what the transport carried) and native (what that was in the "
                "namespace's dtype; more than wire where chunks went as fp8).",
                ["target_class", "form"],
                registry=reg,
            )
        )
        self._push_landed = _Children(
            Histogram(
                f"{PREFIX}push_landed_fraction",
                "Per push that moved layers: the share of them on the target when the "
                "last one was committed here (1 - what prefill's end still waits for).",
                ["target_class"],
                buckets=FRACTION_BUCKETS,
                registry=reg,
            )
        )
        self._push_tail = _Children(
            Histogram(
                f"{PREFIX}push_tail_seconds",
                "Per push that moved layers: from the last layer committed here to its "
                "landing on the target.",
                ["target_class"],
                buckets=LATENCY_BUCKETS,
                registry=reg,
            )
        )
        self._pull_chunks = _Children(
            Counter(
                f"{PREFIX}pull_chunks",
                "Chunks this node was asked to pull (prefetch), by outcome "
                "(pulled, already_local, missing).",
                ["outcome"],
                registry=reg,
            )
        )
        self._pull_tokens = Counter(
            f"{PREFIX}pull_tokens",
            "Tokens of the chunks this node pulled from other nodes.",
            registry=reg,
        )
        self._served_chunks = Counter(
            f"{PREFIX}peer_served_chunks",
            "Chunks this node pinned for other nodes to pull (peer_pin).",
            registry=reg,
        )
        self._served_tokens = Counter(
            f"{PREFIX}peer_served_tokens",
            "Tokens of the chunks this node pinned for other nodes to pull.",
            registry=reg,
        )
        self._control_closed = _Children(
            Counter(
                f"{PREFIX}control_connections_closed",
                "Control and HTTP connections refused or "
                "closed by the daemon, by listener (unix, tcp, http) and reason.",
                ["listener", "reason"],
                registry=reg,
            )
        )
        self._control_pending = Gauge(
            f"{PREFIX}control_pending_connections",
            "Control connections that have not completed hello yet.",
            registry=reg,
        )
        self._index_up = Gauge(
            f"{PREFIX}cluster_index_up",
            "1 while the last register or heartbeat reached the global "
            "prefix index (index: embedded or redis), else 0.",
            ["index"],
            registry=reg,
        )
        self._tenants = _CappedLabel(max_tenants)
        self._engines = _CappedLabel(max_tenants)
        self._classes = _CappedLabel(max_tenants)
        if store is not None:
            reg.register(StoreCollector(store))

    # ------------------------------------------------------------------ control plane

    def session_opened(self) -> None:
        self._sessions.inc()

    def session_closed(self) -> None:
        self._sessions.dec()

    def control_connection_closed(self, listener: str, reason: str) -> None:
        """The daemon refused or closed a control connection, or (listener ``http``) an HTTP
        one (``reason``: a fixed word such as hello_timeout, idle, per_peer_limit,
        frame_too_large; per_ip_limit on HTTP)."""
        self._control_closed(listener, reason).inc()

    def control_pending(self, count: int) -> None:
        self._control_pending.set(count)

    def observe_request(
        self, op: str, seconds: float, error_kind: str | None, *, plane: str = "control"
    ) -> None:
        """One request finished (``error_kind`` None: it succeeded)."""
        self._request_seconds(plane, op).observe(seconds)
        if error_kind is not None:
            self._request_errors(plane, op, error_kind).inc()

    # ------------------------------------------------------------------ store

    def observe_store_op(self, op: str, seconds: float, error_kind: str | None) -> None:
        self._store_seconds(op).observe(seconds)
        if error_kind is not None:
            self._store_errors(op, error_kind).inc()

    def count_lookup(self, tenant: str, lookup_tokens: int, tier_tokens: Mapping[str, int]) -> None:
        """One lookup of ``lookup_tokens`` tokens, of which ``tier_tokens`` were found."""
        label = self.tenant_label(tenant)
        self._lookups(label).inc()
        self._lookup_tokens(label).inc(lookup_tokens)
        for tier, tokens in tier_tokens.items():
            self._hit_tokens(tier, label).inc(tokens)
        self._miss_tokens(label).inc(lookup_tokens - sum(tier_tokens.values()))

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` itself while fewer than ``max_tenants`` were seen, else OTHER_TENANT."""
        return self._tenants.label(tenant)

    def count_engine_traffic(
        self,
        engine: str,
        lookup_tokens: int = 0,
        hit_tokens: int = 0,
        bytes_read: int = 0,
        bytes_written: int = 0,
        conversions: tuple[tuple[str, int], ...] = (),
        served_chunks: int = 0,
        served_tokens: int = 0,
    ) -> None:
        """Traffic of one request of a session that said it serves ``engine`` (its hello's
        ``client``: "vllm", "sglang", "lmcache", ...); ``served_*``: chunks another node's
        puller had pinned here (a peer_pin), counted without the engine label."""
        if served_chunks:
            self._served_chunks.inc(served_chunks)
            self._served_tokens.inc(served_tokens)
        label = self._engines.label(engine or "unknown")
        if lookup_tokens:
            self._engine_lookup_tokens(label).inc(lookup_tokens)
        if hit_tokens:
            self._engine_hit_tokens(label).inc(hit_tokens)
        if bytes_read:
            self._engine_bytes(label, "read").inc(bytes_read)
        if bytes_written:
            self._engine_bytes(label, "written").inc(bytes_written)
        for kind, chunks in conversions:
            self._conversions(label, kind).inc(chunks)

    def describe_node(self, node_id: str, hardware_class: str) -> None:
        self._node_info(node_id, hardware_class).set(1)

    def watch_index(self, backend: str, reachable: Callable[[], bool]) -> None:
        """Report ``reachable()`` of the global index (``backend``: the ``cluster.index``
        setting) at every scrape: the link already knows, so nothing is asked of Redis here."""
        self._index_up.labels(backend).set_function(lambda: float(reachable()))

    def count_push(self, target_class: str, pushed: int, already_there: int, failed: int) -> None:
        label = self._classes.label(target_class or "unknown")
        for outcome, chunks in (
            ("pushed", pushed),
            ("already_there", already_there),
            ("failed", failed),
        ):
            if chunks:
                self._push_chunks(label, outcome).inc(chunks)

    def count_push_bytes(self, target_class: str, wire: int, native: int) -> None:
        label = self._classes.label(target_class or "unknown")
        for form, nbytes in (("wire", wire), ("native", native)):
            if nbytes:
                self._push_bytes(label, form).inc(nbytes)

    def observe_push_timeline(
        self, target_class: str, landed_fraction: float, tail_s: float
    ) -> None:
        """How one push kept up with its producer (:mod:`kvfabric.server.push_timeline`)."""
        label = self._classes.label(target_class or "unknown")
        self._push_landed(label).observe(landed_fraction)
        self._push_tail(label).observe(tail_s)

    def count_pull(self, pulled: int, already_local: int, missing: int, pulled_tokens: int) -> None:
        """One prefetch's chunks by outcome, and the tokens it copied here."""
        for outcome, chunks in (
            ("pulled", pulled),
            ("already_local", already_local),
            ("missing", missing),
        ):
            if chunks:
                self._pull_chunks(outcome).inc(chunks)
        if pulled_tokens:
            self._pull_tokens.inc(pulled_tokens)

    # ------------------------------------------------------------------ exposition

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric: (body, content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# (metric name without prefix and suffix, TierStats / StoreStats attribute, help)
_TIER_GAUGES = (
    ("tier_capacity_bytes", "capacity_bytes", "Configured capacity of the tier in bytes."),
    ("tier_used_bytes", "used_bytes", "Bytes allocated in the tier (SSD: segment bytes)."),
    ("tier_objects", "objects", "Objects (chunks) stored in the tier."),
)
_TIER_COUNTERS = (
    ("tier_evictions", "evictions", "Objects evicted (dropped) from the tier."),
    ("tier_promotions", "promotions", "Objects moved up out of the tier on a hit."),
    ("tier_demotions", "demotions", "Objects moved down out of the tier under pressure."),
    ("tier_in_bytes", "bytes_in", "Bytes written into the tier (commits, demotions to SSD)."),
    ("tier_out_bytes", "bytes_out", "Bytes read out of the tier (pinned reads, SSD read-backs)."),
    (
        "tier_saved_bytes",
        "bytes_saved",
        "Bytes an fp8 SSD tier saved: the chunks' native size minus what it wrote.",
    ),
    (
        "tier_corrupt_records",
        "corrupt_records",
        "SSD records that failed their checks; skipped or dropped, never served.",
    ),
    ("tier_torn_records", "torn_records", "Torn (partially written) SSD records skipped."),
    (
        "tier_refused_demotions",
        "refused_demotions",
        "Objects evicted from memory instead of demoted because the SSD tier was degraded.",
    ),
    (
        "tier_quota_refused_demotions",
        "quota_refused_demotions",
        (
            "Objects evicted from memory instead of demoted because their tenant's own SSD records "
            "could not make room in its SSD quota."
        ),
    ),
)
_STORE_COUNTERS = (
    ("store_commits", "puts", "Objects committed (every layer written)."),
    ("store_pins", "gets", "Objects pinned for reading."),
    ("store_deletes", "deletes", "Objects deleted on request."),
    (
        "store_leases_expired",
        "expired_leases",
        "Reservations and pins reclaimed by the store after their deadline passed.",
    ),
    (
        "store_aborted_writes",
        "aborted_writes",
        "Reservations that ended without a complete object (aborted, expired or deleted).",
    ),
)


class _Children(Generic[M]):
    """The labelled children of one metric, kept by label values: ``metric.labels(...)``
    validates, converts and locks on every call, a few microseconds each, several times per
    request. Never more entries than the metric has series: every label value passed is a
    fixed name (plane, op, tier, error kind, direction) or capped by a :class:`_CappedLabel`."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:  # two threads may both ask labels(): it returns the same child
            child = self._children[values] = self.metric.labels(*values)
        return child


class _CappedLabel:
    """Label values as given while fewer than ``limit`` distinct ones were seen, then
    OTHER_TENANT: a client cannot blow up the series count."""

    def __init__(self, limit: int) -> None:
        self._seen: set[str] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def label(self, value: str) -> str:
        if value in self._seen:  # the common case needs no lock: values are never removed
            return value
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self._limit:
                self._seen.add(value)
                return value
        return OTHER_TENANT


class StoreCollector(Collector):
    """Tier gauges and store counters from one ``store.stats()`` snapshot per scrape."""

    def __init__(self, store: StatsSource) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._store.stats()
        except Exception:  # a failing store must not take the event metrics down with it
            log.exception("store stats unavailable for this scrape")
            return
        yield from _families(stats)

    def describe(self) -> Iterable[Metric]:
        return _families(None)


def _families(stats: StoreStats | None) -> list[Metric]:
    """The store's metric families, with samples from ``stats`` (empty when None)."""
    info = GaugeMetricFamily(
        f"{PREFIX}tier_info", "Tier kind by tier name (always 1).", labels=["tier", "kind"]
    )
    tier_families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
        (attr, GaugeMetricFamily(PREFIX + name, doc, labels=["tier"]))
        for name, attr, doc in _TIER_GAUGES
    ]
    tier_families += [
        (attr, CounterMetricFamily(PREFIX + name, doc, labels=["tier"]))
        for name, attr, doc in _TIER_COUNTERS
    ]
    store_families = [
        (attr, CounterMetricFamily(PREFIX + name, doc)) for name, attr, doc in _STORE_COUNTERS
    ]
    degraded = GaugeMetricFamily(
        f"{PREFIX}tier_degraded",
        "1 while a disk fault (full disk, quota, I/O error) keeps "
        "new objects out of the tier; what it holds stays readable.",
        labels=["tier"],
    )
    disk_errors = CounterMetricFamily(
        f"{PREFIX}tier_disk_errors",
        "I/O errors of the SSD tier, by errno name (ENOSPC, EDQUOT, EIO, ...).",
        labels=["tier", "errno"],
    )
    tenant_used = GaugeMetricFamily(
        f"{PREFIX}tier_tenant_used_bytes",
        "A configured tenant's bytes in the tier (memory: "
        "its arena's pages in use; SSD: its records).",
        labels=["tier", "tenant"],
    )
    if stats is not None:
        for tier in stats.tiers:
            info.add_metric([tier.name, tier.kind], 1)
            for attr, family in tier_families:
                family.add_metric([tier.name], getattr(tier, attr))
            degraded.add_metric([tier.name], int(tier.degraded))
            for name, count in sorted(tier.disk_errors.items()):  # a few errno names at most
                disk_errors.add_metric([tier.name, name], count)
            for tenant, used in sorted(tier.tenant_bytes.items()):  # configured tenants only
                tenant_used.add_metric([tier.name, tenant], used)
        for attr, family in store_families:
            family.add_metric([], getattr(stats, attr))
    return [
        info,
        *(f for _, f in tier_families),
        degraded,
        disk_errors,
        tenant_used,
        *(f for _, f in store_families),
    ]
