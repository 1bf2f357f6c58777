"""Metrics: private registry, token accounting, store snapshot collector, documentation."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.api.metrics import OTHER_TENANT, Metrics, error_kind
from kvfabric.errors import NotFoundError, SpecError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.store.stats import NamespaceStats, StoreStats, TierStats
from kvfabric.tiers.base import TierKind

DOCS = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
NS = Namespace("tiny", SPEC, tenant_salt="acme")


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


class FixedStats:
    """A stats source with a distinct number in every field, to catch crossed wires."""

    def stats(self) -> StoreStats:
        ssd = TierStats(
            name="ssd",
            kind="ssd",
            capacity_bytes=1000,
            used_bytes=400,
            objects=7,
            hit_tokens=0,
            hit_chunks=0,
            evictions=11,
            promotions=12,
            demotions=13,
            bytes_in=14,
            bytes_out=15,
            corrupt_records=16,
            torn_records=17,
            degraded=True,
            disk_errors={"ENOSPC": 18, "EIO": 19},
            refused_demotions=20,
            quota_refused_demotions=26,
            tenant_bytes={"acme": 27, "zeta": 0},
        )
        dram = TierStats(
            name="dram",
            kind="dram",
            capacity_bytes=500,
            used_bytes=100,
            objects=3,
            hit_tokens=0,
            hit_chunks=0,
            evictions=21,
            promotions=22,
            demotions=23,
            bytes_in=24,
            bytes_out=25,
            tenant_bytes={"acme": 28},
        )
        return StoreStats(
            tiers=(dram, ssd),
            objects=10,
            lookups=0,
            lookup_tokens=0,
            hit_tokens=0,
            miss_tokens=0,
            puts=31,
            gets=32,
            deletes=33,
            expired_leases=34,
            aborted_writes=35,
            namespaces=(NamespaceStats("tiny", "acme", 1, 2, 3),),
        )


class BrokenStats:
    def stats(self) -> StoreStats:
        raise RuntimeError("store is gone")


def test_registry_is_private_so_two_daemons_coexist() -> None:
    first, second = Metrics(FixedStats()), Metrics(FixedStats())  # no duplicate-name error
    first.session_opened()
    assert value(first, "kvfabric_sessions") == 1
    assert value(second, "kvfabric_sessions") == 0
    assert REGISTRY.get_sample_value("kvfabric_sessions") is None


def test_sessions_gauge_follows_opens_and_closes() -> None:
    metrics = Metrics()
    for _ in range(3):
        metrics.session_opened()
    metrics.session_closed()
    assert value(metrics, "kvfabric_sessions") == 2


def test_lookup_tokens_split_into_hits_per_tier_and_misses() -> None:
    metrics = Metrics()
    metrics.count_lookup("acme", 64, {"dram": 16, "ssd": 32})
    metrics.count_lookup("acme", 32, {})
    assert value(metrics, "kvfabric_lookups_total", tenant="acme") == 2
    assert value(metrics, "kvfabric_lookup_tokens_total", tenant="acme") == 96
    assert value(metrics, "kvfabric_hit_tokens_total", tier="dram", tenant="acme") == 16
    assert value(metrics, "kvfabric_hit_tokens_total", tier="ssd", tenant="acme") == 32
    assert value(metrics, "kvfabric_miss_tokens_total", tenant="acme") == 16 + 32
    assert value(metrics, "kvfabric_lookup_tokens_total", tenant="other") is None


def test_tenant_labels_are_capped_and_overflow_into_other() -> None:
    metrics = Metrics(max_tenants=2)
    for tenant in ("a", "b", "c", "d", "a"):
        metrics.count_lookup(tenant, 16, {"dram": 16})
    assert value(metrics, "kvfabric_lookups_total", tenant="a") == 2
    assert value(metrics, "kvfabric_lookups_total", tenant="b") == 1
    assert value(metrics, "kvfabric_lookups_total", tenant="c") is None
    assert value(metrics, "kvfabric_lookups_total", tenant=OTHER_TENANT) == 2
    assert value(metrics, "kvfabric_hit_tokens_total", tier="dram", tenant=OTHER_TENANT) == 32
    with pytest.raises(ValueError):
        Metrics(max_tenants=0)


def test_repeated_label_values_keep_adding_to_one_series_each() -> None:
    # Labelled children are cached per label values: every call must land in the same series,
    # and overflowing tenants in the one OTHER_TENANT series, never in new ones.
    metrics = Metrics(max_tenants=2)
    for _ in range(3):
        for tenant in ("a", "b", "c", "d"):
            metrics.count_lookup(tenant, 16, {"dram": 16})
        metrics.observe_request("get", 0.001, "not_found")
        metrics.count_engine_traffic("vllm", lookup_tokens=16, bytes_read=8)
    assert value(metrics, "kvfabric_lookups_total", tenant="a") == 3
    assert value(metrics, "kvfabric_lookups_total", tenant=OTHER_TENANT) == 6
    assert value(metrics, "kvfabric_hit_tokens_total", tier="dram", tenant="b") == 48
    assert value(metrics, "kvfabric_request_duration_seconds_count", plane="control", op="get") == 3
    assert (
        value(metrics, "kvfabric_request_errors_total", plane="control", op="get", kind="not_found")
        == 3
    )
    assert value(metrics, "kvfabric_engine_bytes_total", engine="vllm", direction="read") == 24
    lookups = [
        s
        for f in metrics.registry.collect()
        if f.name == "kvfabric_lookups"
        for s in f.samples
        if s.name == "kvfabric_lookups_total"
    ]
    assert sorted(s.labels["tenant"] for s in lookups) == [OTHER_TENANT, "a", "b"]


def test_requests_are_timed_per_plane_and_errors_counted_by_kind() -> None:
    metrics = Metrics()
    metrics.observe_request("get", 0.002, None)
    metrics.observe_request("get", 0.5, "not_found")
    metrics.observe_request("lookup", 0.001, "forbidden", plane="http")
    assert value(metrics, "kvfabric_request_duration_seconds_count", plane="control", op="get") == 2
    assert value(
        metrics, "kvfabric_request_duration_seconds_sum", plane="control", op="get"
    ) == pytest.approx(0.502)
    assert (
        value(
            metrics,
            "kvfabric_request_duration_seconds_bucket",
            plane="control",
            op="get",
            le="0.0025",
        )
        == 1
    )
    assert (
        value(metrics, "kvfabric_request_errors_total", plane="control", op="get", kind="not_found")
        == 1
    )
    assert (
        value(metrics, "kvfabric_request_errors_total", plane="http", op="lookup", kind="forbidden")
        == 1
    )


def test_store_ops_are_timed_and_errors_counted_by_kind() -> None:
    metrics = Metrics()
    metrics.observe_store_op("put", 0.0001, None)
    metrics.observe_store_op("put", 0.0002, "no_capacity")
    assert value(metrics, "kvfabric_store_operation_duration_seconds_count", op="put") == 2
    assert value(metrics, "kvfabric_store_errors_total", op="put", kind="no_capacity") == 1
    assert value(metrics, "kvfabric_store_errors_total", op="put", kind="not_found") is None


def test_error_kind_is_the_kvfabric_kind_or_internal() -> None:
    assert error_kind(NotFoundError("x")) == "not_found"
    assert error_kind(SpecError("x")) == "bad_spec"
    assert error_kind(RuntimeError("x")) == "internal"


def test_store_snapshot_maps_every_field_to_its_metric() -> None:
    metrics = Metrics(FixedStats())
    expected = {  # (metric, tier): value
        ("kvfabric_tier_capacity_bytes", "dram"): 500,
        ("kvfabric_tier_capacity_bytes", "ssd"): 1000,
        ("kvfabric_tier_used_bytes", "dram"): 100,
        ("kvfabric_tier_used_bytes", "ssd"): 400,
        ("kvfabric_tier_objects", "dram"): 3,
        ("kvfabric_tier_objects", "ssd"): 7,
        ("kvfabric_tier_evictions_total", "dram"): 21,
        ("kvfabric_tier_evictions_total", "ssd"): 11,
        ("kvfabric_tier_promotions_total", "dram"): 22,
        ("kvfabric_tier_promotions_total", "ssd"): 12,
        ("kvfabric_tier_demotions_total", "dram"): 23,
        ("kvfabric_tier_demotions_total", "ssd"): 13,
        ("kvfabric_tier_in_bytes_total", "dram"): 24,
        ("kvfabric_tier_in_bytes_total", "ssd"): 14,
        ("kvfabric_tier_out_bytes_total", "dram"): 25,
        ("kvfabric_tier_out_bytes_total", "ssd"): 15,
        ("kvfabric_tier_corrupt_records_total", "dram"): 0,
        ("kvfabric_tier_corrupt_records_total", "ssd"): 16,
        ("kvfabric_tier_torn_records_total", "dram"): 0,
        ("kvfabric_tier_torn_records_total", "ssd"): 17,
        ("kvfabric_tier_degraded", "dram"): 0,
        ("kvfabric_tier_degraded", "ssd"): 1,
        ("kvfabric_tier_refused_demotions_total", "dram"): 0,
        ("kvfabric_tier_refused_demotions_total", "ssd"): 20,
        ("kvfabric_tier_quota_refused_demotions_total", "dram"): 0,
        ("kvfabric_tier_quota_refused_demotions_total", "ssd"): 26,
    }
    for (name, tier), number in expected.items():
        assert value(metrics, name, tier=tier) == number, name
    assert value(metrics, "kvfabric_tier_info", tier="ssd", kind="ssd") == 1
    assert value(metrics, "kvfabric_tier_disk_errors_total", tier="ssd", errno="ENOSPC") == 18
    assert value(metrics, "kvfabric_tier_disk_errors_total", tier="ssd", errno="EIO") == 19
    for tier, tenant, used in (("ssd", "acme", 27), ("ssd", "zeta", 0), ("dram", "acme", 28)):
        assert value(metrics, "kvfabric_tier_tenant_used_bytes", tier=tier, tenant=tenant) == used
    store_counters = {
        "kvfabric_store_commits_total": 31,
        "kvfabric_store_pins_total": 32,
        "kvfabric_store_deletes_total": 33,
        "kvfabric_store_leases_expired_total": 34,
        "kvfabric_store_aborted_writes_total": 35,
    }
    for name, number in store_counters.items():
        assert value(metrics, name) == number, name


def test_store_snapshot_follows_a_live_store(tmp_path: Path) -> None:
    config = StoreConfig(
        data_dir=str(tmp_path),
        tiers=(TierConfig(TierKind.DRAM, 8 * SPEC.chunk_bytes, page_size=4096),),
    )
    with TieredStore(config, maintenance=False) as store:
        metrics = Metrics(store)
        for ref in chunk_hashes(NS, list(range(3 * SPEC.chunk_tokens))):
            store.put(NS, ref.key, np.zeros(SPEC.chunk_bytes, np.uint8), parent=ref.parent)
        assert value(metrics, "kvfabric_tier_objects", tier="dram") == 3
        assert value(metrics, "kvfabric_tier_used_bytes", tier="dram") == 3 * SPEC.chunk_bytes
        assert value(metrics, "kvfabric_tier_in_bytes_total", tier="dram") == 3 * SPEC.chunk_bytes
        assert value(metrics, "kvfabric_store_commits_total") == 3
        assert store.evict() == 3
        assert value(metrics, "kvfabric_tier_objects", tier="dram") == 0  # read at scrape time
        assert value(metrics, "kvfabric_tier_evictions_total", tier="dram") == 3


def test_a_failing_store_leaves_the_event_metrics_scrapable() -> None:
    metrics = Metrics(BrokenStats())
    metrics.session_opened()
    body, _ = metrics.render()
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "kvfabric_sessions" in names
    assert not any(name.startswith("kvfabric_tier_") for name in names)


def test_render_is_prometheus_text() -> None:
    metrics = Metrics(FixedStats())
    metrics.count_lookup("acme", 32, {"dram": 16})
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("kvfabric_hit_tokens_total", (("tenant", "acme"), ("tier", "dram")))] == 16
    assert samples[("kvfabric_tier_objects", (("tier", "ssd"),))] == 7


def _exposed_names(metrics: Metrics) -> set[str]:
    return {
        f"{f.name}_total" if f.type == "counter" else f.name for f in metrics.registry.collect()
    }


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    exposed = _exposed_names(Metrics(FixedStats()))
    documented = set(re.findall(r"^\| `(kvfabric_\w+)`", DOCS.read_text(), re.MULTILINE))
    assert exposed == documented
    assert all(name.startswith("kvfabric_") for name in exposed)


def _exposed_types_and_labels(metrics: Metrics) -> dict[str, tuple[str, frozenset[str]]]:
    # Event metrics may have no samples yet: their declared label names are the truth.
    # (labelled metrics sit in a cache of their children: unwrap those)
    wrappers = (getattr(attr, "metric", attr) for attr in vars(metrics).values())
    declared = {
        w._name: frozenset(w._labelnames) for w in wrappers if isinstance(w, MetricWrapperBase)
    }
    out = {}
    for family in metrics.registry.collect():
        labels = declared.get(
            family.name, frozenset(k for s in family.samples for k in s.labels) - {"le"}
        )
        name = f"{family.name}_total" if family.type == "counter" else family.name
        out[name] = (family.type, labels)
    return out


def test_every_documented_metric_has_its_real_type_and_labels() -> None:
    exposed = _exposed_types_and_labels(Metrics(FixedStats()))
    rows = re.findall(
        r"^\| `(kvfabric_\w+)` \| (\w+) \| ([^|]*) \|", DOCS.read_text(), re.MULTILINE
    )
    documented = {
        name: (kind, frozenset(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows
    }
    assert documented == exposed
