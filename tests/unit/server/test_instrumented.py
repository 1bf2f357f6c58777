"""InstrumentedStore: a faithful TieredStore that also counts tokens, latency and errors."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvfabric.api.metrics import OTHER_TENANT, Metrics
from kvfabric.errors import AlreadyExistsError, NotFoundError, SpecError
from kvfabric.hashing import chunk_hashes, chunk_keys
from kvfabric.server.instrumented import InstrumentedStore
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
CT = SPEC.chunk_tokens
CHUNK = SPEC.chunk_bytes
ACME = Namespace("tiny", SPEC, tenant_salt="acme")
GLOBEX = Namespace("tiny", SPEC, tenant_salt="globex")
WRAPPED = ("lookup", "lookup_tokens", "reserve", "put", "get", "pin", "contains", "delete", "evict")


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, CHUNK, dtype=np.uint8)


def make(tmp_path: Path, *tiers: TierConfig) -> tuple[TieredStore, Metrics, InstrumentedStore]:
    tiers = tiers or (TierConfig(TierKind.DRAM, 16 * CHUNK, page_size=4096),)
    store = TieredStore(StoreConfig(data_dir=str(tmp_path), tiers=tiers), maintenance=False)
    metrics = Metrics(store)
    return store, metrics, InstrumentedStore(store, metrics)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[TieredStore, Metrics, InstrumentedStore]]:
    store, metrics, instrumented = make(tmp_path)
    yield store, metrics, instrumented
    store.close()


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def prompt(n_tokens: int) -> list[int]:
    return list(range(1000, 1000 + n_tokens))


def put_prefix(
    store: InstrumentedStore | TieredStore, ns: Namespace, tokens: list[int], n_chunks: int
) -> list[bytes]:
    refs = chunk_hashes(ns, tokens, include_partial=False)[:n_chunks]
    for i, ref in enumerate(refs):
        assert store.put(ns, ref.key, payload(i), parent=ref.parent)
    return [r.key for r in refs]


def test_lookup_counts_hit_tokens_per_tier_and_tenant_and_miss_tokens(parts) -> None:
    store, metrics, instrumented = parts
    tokens = prompt(3 * CT)
    put_prefix(instrumented, ACME, tokens, 2)
    result = instrumented.lookup_tokens(ACME, tokens)
    assert (result.matched_tokens, result.tier_tokens) == (2 * CT, {"dram": 2 * CT})
    assert value(metrics, "kvfabric_hit_tokens_total", tier="dram", tenant="acme") == 2 * CT
    assert value(metrics, "kvfabric_miss_tokens_total", tenant="acme") == CT
    assert value(metrics, "kvfabric_lookup_tokens_total", tenant="acme") == 3 * CT
    assert value(metrics, "kvfabric_lookups_total", tenant="acme") == 1
    # the store's own accounting agrees with ours
    stats = store.stats()
    assert (stats.hit_tokens, stats.miss_tokens, stats.lookup_tokens) == (2 * CT, CT, 3 * CT)


def test_lookup_by_keys_counts_like_lookup_by_tokens(parts) -> None:
    _, metrics, instrumented = parts
    tokens = prompt(4 * CT)
    put_prefix(instrumented, ACME, tokens, 1)
    result = instrumented.lookup(ACME, chunk_keys(ACME, tokens))
    assert (result.requested_chunks, result.matched_chunks) == (4, 1)
    assert value(metrics, "kvfabric_hit_tokens_total", tier="dram", tenant="acme") == CT
    assert value(metrics, "kvfabric_miss_tokens_total", tenant="acme") == 3 * CT


def test_a_partial_last_chunk_is_neither_hit_nor_miss(parts) -> None:
    _, metrics, instrumented = parts
    tokens = prompt(2 * CT + CT // 2)
    put_prefix(instrumented, ACME, tokens, 2)
    instrumented.lookup_tokens(ACME, tokens)
    assert value(metrics, "kvfabric_lookup_tokens_total", tenant="acme") == 2 * CT
    assert value(metrics, "kvfabric_miss_tokens_total", tenant="acme") == 0


def test_tenants_are_counted_apart(parts) -> None:
    _, metrics, instrumented = parts
    tokens = prompt(2 * CT)
    put_prefix(instrumented, ACME, tokens, 2)
    put_prefix(instrumented, GLOBEX, list(range(50_000, 50_000 + CT)), 1)  # globex holds data
    instrumented.lookup_tokens(GLOBEX, tokens)  # same prompt, other tenant: all misses
    assert value(metrics, "kvfabric_hit_tokens_total", tier="dram", tenant="globex") == 0
    assert value(metrics, "kvfabric_miss_tokens_total", tenant="globex") == 2 * CT
    assert value(metrics, "kvfabric_lookup_tokens_total", tenant="acme") == 0


def test_a_lookup_in_a_namespace_holding_nothing_takes_no_tenant_label(parts) -> None:
    """Regression: on the old code every tenant salt looked up took one of the capped
    tenant label slots, data or not: made-up salts pushed real tenants under __other__."""
    _, metrics, instrumented = parts
    instrumented.lookup_tokens(GLOBEX, prompt(2 * CT))
    assert value(metrics, "kvfabric_lookup_tokens_total", tenant="globex") == 0
    assert value(metrics, "kvfabric_miss_tokens_total", tenant=OTHER_TENANT) == 2 * CT


def test_hits_are_attributed_to_the_tier_that_held_them(tmp_path: Path) -> None:
    store, metrics, instrumented = make(
        tmp_path,
        TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=4096),
        TierConfig(TierKind.CXL, 8 * CHUNK, page_size=4096, numa_node=0),
    )
    tokens = prompt(4 * CT)
    keys = put_prefix(instrumented, ACME, tokens, 4)  # dram holds two: two were demoted
    result = instrumented.lookup_tokens(ACME, tokens)
    assert result.tier_tokens == {"dram": 2 * CT, "cxl": 2 * CT}
    assert {instrumented.tier_of(ACME, k) for k in keys} == {"dram", "cxl"}
    for tier in ("dram", "cxl"):
        assert value(metrics, "kvfabric_hit_tokens_total", tier=tier, tenant="acme") == 2 * CT
    assert value(metrics, "kvfabric_miss_tokens_total", tenant="acme") == 0
    store.close()


def test_every_wrapped_operation_is_timed(parts) -> None:
    _, metrics, instrumented = parts
    tokens = prompt(2 * CT)
    refs = chunk_hashes(ACME, tokens)
    instrumented.put(ACME, refs[0].key, payload(0))
    with instrumented.reserve(ACME, refs[1].key, parent=refs[0].key) as writer:
        writer.write(payload(1))
        writer.commit()
    instrumented.get(ACME, refs[0].key).release()
    instrumented.pin(ACME, refs[1].key, lease_s=5).release()
    instrumented.lookup(ACME, [refs[0].key])
    instrumented.lookup_tokens(ACME, tokens)
    assert instrumented.contains(ACME, refs[1].key)
    assert instrumented.delete(ACME, refs[1].key)
    assert instrumented.evict() == 1
    for op in WRAPPED:
        assert value(metrics, "kvfabric_store_operation_duration_seconds_count", op=op) == 1, op
        assert value(metrics, "kvfabric_store_operation_duration_seconds_sum", op=op) > 0, op


def test_errors_are_counted_by_kind_and_raised_unchanged(parts) -> None:
    _, metrics, instrumented = parts
    key = chunk_keys(ACME, prompt(CT))[0]
    with pytest.raises(NotFoundError):
        instrumented.get(ACME, key)
    instrumented.put(ACME, key, payload(0))
    with pytest.raises(AlreadyExistsError):
        instrumented.reserve(ACME, key)
    with pytest.raises(NotFoundError, match="no tier"):
        instrumented.evict(tier="tape")
    with pytest.raises(SpecError):
        instrumented.lookup_tokens(ACME, [1 << 40])  # not an int32 token id
    assert value(metrics, "kvfabric_store_errors_total", op="get", kind="not_found") == 1
    assert value(metrics, "kvfabric_store_errors_total", op="reserve", kind="exists") == 1
    assert value(metrics, "kvfabric_store_errors_total", op="evict", kind="not_found") == 1
    assert value(metrics, "kvfabric_store_errors_total", op="lookup_tokens", kind="bad_spec") == 1
    assert value(metrics, "kvfabric_store_operation_duration_seconds_count", op="get") == 1
    assert value(metrics, "kvfabric_lookup_tokens_total", tenant="acme") == 0  # failed: no tokens


def test_put_of_an_existing_key_is_not_an_error(parts) -> None:
    _, metrics, instrumented = parts
    key = chunk_keys(ACME, prompt(CT))[0]
    assert instrumented.put(ACME, key, payload(0))
    assert not instrumented.put(ACME, key, payload(0))
    assert value(metrics, "kvfabric_store_operation_duration_seconds_count", op="put") == 2
    assert value(metrics, "kvfabric_store_errors_total", op="put", kind="exists") == 0


def test_data_round_trips_through_the_wrapper(parts) -> None:
    store, _, instrumented = parts
    key = chunk_keys(ACME, prompt(CT))[0]
    data = payload(7)
    instrumented.put(ACME, key, data)
    with instrumented.get(ACME, key) as reader:
        assert reader.to_bytes() == data.tobytes()
    with store.get(ACME, key) as reader:  # it really is in the wrapped store
        assert reader.to_bytes() == data.tobytes()


def test_unwrapped_members_of_the_store_protocol_are_delegated(parts) -> None:
    store, _, instrumented = parts
    key = chunk_keys(ACME, prompt(CT))[0]
    instrumented.put(ACME, key, payload(0))
    assert instrumented.store is store
    assert instrumented.tier_names == store.tier_names == ["dram"]
    assert instrumented.tier_of(ACME, key) == "dram"
    assert instrumented.stats().puts == 1
    instrumented.flush()  # no SSD tier: returns at once
    with pytest.raises(AttributeError):
        instrumented.no_such_method  # noqa: B018


@pytest.mark.parametrize("name", WRAPPED)
def test_wrapped_signatures_match_the_store(name: str) -> None:
    assert inspect.signature(getattr(InstrumentedStore, name)) == inspect.signature(
        getattr(TieredStore, name)
    )
