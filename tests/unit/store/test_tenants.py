"""Tenants in the store: arenas of their own, quotas per tier, reservations and namespaces,
and namespaces forgotten once empty (kvfabric/store/tenants.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvfabric.errors import QuotaExceededError
from kvfabric.hashing import chunk_keys
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=16)
CHUNK = SPEC.chunk_bytes  # 16 KiB
PAGE = 4096
NS_A = Namespace("m", SPEC, tenant_salt="team-a")
NS_B = Namespace("m", SPEC, tenant_salt="team-b")
NS_ADMIN = Namespace("m", SPEC)


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, CHUNK, dtype=np.uint8
    )


def make_store(
    tmp_path: Path,
    chunks: int = 16,
    quotas: dict | None = None,
    tiers: tuple[TierConfig, ...] | None = None,
    **policy: object,
) -> TieredStore:
    tiers = tiers or (TierConfig(TierKind.DRAM, chunks * CHUNK, page_size=PAGE),)
    config = StoreConfig.from_dict(
        {"data_dir": str(tmp_path), "tiers": list(tiers), "quotas": quotas or {}, **policy}
    )
    return TieredStore(config, maintenance=False, tenants=["team-a", "team-b"])


def keys(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    return chunk_keys(ns, list(range(start, start + n * SPEC.chunk_tokens)))


def arena_of(store: TieredStore, ns: Namespace, key: bytes) -> int:
    with store.get(ns, key) as reader:
        return reader.arena_id  # type: ignore[return-value]


def test_each_tenants_objects_live_in_arenas_of_its_own(tmp_path: Path) -> None:
    """Regression: on the old code every object lived in one arena per tier, and every
    session was handed it (tenant A read tenant B's chunk and overwrote it)."""
    store = make_store(tmp_path)
    try:
        (a,), (b,), (n,) = keys(NS_A, 1), keys(NS_B, 1, 100), keys(NS_ADMIN, 1, 200)
        for ns, key in ((NS_A, a), (NS_B, b), (NS_ADMIN, n)):
            assert store.put(ns, key, payload(key))
        ids = {arena_of(store, NS_A, a), arena_of(store, NS_B, b), arena_of(store, NS_ADMIN, n)}
        assert len(ids) == 3
        assert arena_of(store, NS_ADMIN, n) == 0  # the default arena keeps the tier's id
        mine = store.arenas("team-a")
        assert [x.arena_id for x in mine] == [arena_of(store, NS_A, a)]
        assert [x.tenant for x in store.arenas(None)] == [None]
        assert len(store.arenas()) == 3 and len(store.host_arenas()) == 3
        assert store.arenas("nobody") == []
        # A's arena holds A's bytes and nothing of B's
        a_bytes = mine[0].arena.array.tobytes()
        assert payload(a).tobytes() in a_bytes and payload(b).tobytes() not in a_bytes
        fds = {x.arena.fd for x in store.arenas()}
        assert len(fds) == 3
    finally:
        store.close()


def test_one_tenant_holding_its_dram_quota_in_reservations_does_not_starve_another(
    tmp_path: Path,
) -> None:
    """Regression: on the old code one tenant holding all DRAM in renewed reservations left
    the others nothing (569 of 578 puts no_capacity); with a quota it holds at most its share
    and gets quota_exceeded itself."""
    store = make_store(tmp_path, quotas={"*": {"dram": "50%"}})
    try:
        held = []
        with pytest.raises(QuotaExceededError):
            for key in keys(NS_A, 16):
                held.append(store.reserve(NS_A, key))  # never committed: all pinned
        assert len(held) == 8
        for key in keys(NS_B, 8, 1000):
            assert store.put(NS_B, key, payload(key))
        for writer in held:
            writer.close()
    finally:
        store.close()


def test_a_tenant_at_its_quota_makes_room_among_its_own_objects_only(tmp_path: Path) -> None:
    store = make_store(tmp_path, quotas={"team-a": {"dram": 4 * CHUNK}})
    try:
        b_keys = keys(NS_B, 6, 1000)
        for key in b_keys:  # older than all of A's: global LRU would take them first
            assert store.put(NS_B, key, payload(key))
        a_keys = keys(NS_A, 10)
        for key in a_keys:
            assert store.put(NS_A, key, payload(key))
        assert all(store.contains(NS_B, key) for key in b_keys)  # untouched
        kept = [k for k in a_keys if store.contains(NS_A, k)]
        assert len(kept) == 4 and set(kept) == set(a_keys[-4:])
        for key in kept + b_keys:
            ns = NS_A if key in kept else NS_B
            with store.get(ns, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
    finally:
        store.close()


def test_reservations_in_flight_are_bounded_per_tenant(tmp_path: Path) -> None:
    store = make_store(tmp_path, quotas={"team-a": {"reservations": 3}})
    try:
        writers = [store.reserve(NS_A, key) for key in keys(NS_A, 3)]
        with pytest.raises(QuotaExceededError, match="reservations in flight"):
            store.reserve(NS_A, keys(NS_A, 1, 500)[0])
        assert store.put(NS_B, keys(NS_B, 1)[0], payload(keys(NS_B, 1)[0]))  # others unaffected
        writers[0].abort()
        writers[1].commit()
        extra = store.reserve(NS_A, keys(NS_A, 1, 600)[0])
        for writer in (writers[2], extra):
            writer.abort()
    finally:
        store.close()


def test_an_expired_reservation_counts_until_its_writer_lets_go(tmp_path: Path) -> None:
    store = make_store(tmp_path, quotas={"team-a": {"reservations": 1}}, reservation_timeout_s=0.05)
    try:
        writer = store.reserve(NS_A, keys(NS_A, 1)[0])
        time.sleep(0.1)
        store.maintain()
        with pytest.raises(QuotaExceededError):
            store.reserve(NS_A, keys(NS_A, 1, 100)[0])
        writer.close()
        store.reserve(NS_A, keys(NS_A, 1, 100)[0]).abort()
    finally:
        store.close()


def test_namespaces_per_tenant_are_bounded_and_empty_ones_are_forgotten(tmp_path: Path) -> None:
    """Regression: on the old code every namespace ever reserved in stayed in the store's
    table (one tenant's 60,536 reserve+abort calls filled it for everyone)."""
    store = make_store(tmp_path, quotas={"team-a": {"namespaces": 2}})
    try:
        for i in range(300):  # reserve + abort in ever new namespaces: nothing stays
            ns = Namespace(f"model-{i}", SPEC, tenant_salt="team-a")
            store.reserve(ns, keys(ns, 1)[0]).abort()
        assert store._namespaces == {} and not store.holds_namespace(NS_A)
        first, second, third = (Namespace(f"m{i}", SPEC, tenant_salt="team-a") for i in range(3))
        for ns in (first, second):
            key = keys(ns, 1)[0]
            assert store.put(ns, key, payload(key))
        with pytest.raises(QuotaExceededError, match="namespaces"):
            store.reserve(third, keys(third, 1)[0])
        other = Namespace("m9", SPEC, tenant_salt="team-b")  # another tenant is not limited
        assert store.put(other, keys(other, 1)[0], payload(keys(other, 1)[0]))
        assert store.delete(first, keys(first, 1)[0])  # emptied: a slot comes back
        key = keys(third, 1)[0]
        assert store.put(third, key, payload(key))
        assert len(store._namespaces) == 3
    finally:
        store.close()


def test_lookups_of_empty_namespaces_leave_no_counters(tmp_path: Path) -> None:
    """Regression: on the old code a namespace reserved in once kept per-namespace lookup
    counters (and a tenant label slot in the metrics) for good."""
    store = make_store(tmp_path)
    try:
        key = keys(NS_A, 1)[0]
        store.reserve(NS_A, key).abort()
        store.lookup(NS_A, [key])
        assert store.stats().namespaces == ()
        assert store.put(NS_A, key, payload(key))
        store.lookup(NS_A, [key])
        assert [n.tenant for n in store.stats().namespaces] == ["team-a"]
        assert store.delete(NS_A, key)
        assert store.stats().namespaces == ()
    finally:
        store.close()


def test_memory_of_evicted_objects_goes_back_to_the_os(tmp_path: Path) -> None:
    """Regression: on the old code an evict-all left the arena's pages resident (the
    daemon's RSS stayed at its peak: 44 -> 172 MB for 45,768 objects)."""
    store = make_store(tmp_path, chunks=64, free_memory_kept=0.1)
    try:
        for key in keys(NS_A, 64):
            assert store.put(NS_A, key, payload(key))
        arena = store.arenas("team-a")[0].arena
        full = os.fstat(arena.fd).st_blocks * 512
        assert full >= 64 * CHUNK
        assert store.evict() == 64
        store.maintain()
        kept = os.fstat(arena.fd).st_blocks * 512
        assert kept <= 0.1 * 64 * CHUNK + PAGE, (full, kept)
        for key in keys(NS_A, 8, 5000):  # the memory comes back when wanted
            assert store.put(NS_A, key, payload(key))
            with store.get(NS_A, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
    finally:
        store.close()
