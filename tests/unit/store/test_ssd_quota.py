"""Tenants' SSD quotas in the store (``store.quotas.<tenant>.ssd``; kvfabric/store/ssd_usage.py
and the quota path of kvfabric/store/placement.py): a tenant at its quota gives up its own
SSD records, never another tenant's; its bytes are counted exactly, across a restart."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvfabric.hashing import chunk_keys
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind
from kvfabric.tiers.disk import DiskTier

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=16)
CHUNK = SPEC.chunk_bytes  # 16 KiB
PAGE = 4096
RECORD = CHUNK + 4096  # an SSD record: a header page, then the payload
NS_A = Namespace("m", SPEC, tenant_salt="team-a")
NS_B = Namespace("m", SPEC, tenant_salt="team-b")


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, CHUNK, dtype=np.uint8
    )


def make_store(tmp_path: Path, quotas: dict, *, ssd_records: int = 24) -> TieredStore:
    tiers = [
        TierConfig(TierKind.DRAM, 4 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.SSD, ssd_records * RECORD, segment_bytes=8 * RECORD),
    ]
    config = StoreConfig.from_dict({"data_dir": str(tmp_path), "tiers": tiers, "quotas": quotas})
    return TieredStore(config, maintenance=False, tenants=["team-a", "team-b"])


def prompts(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    """Keys of ``n`` one-chunk prompts (each a chain of its own: an SSD leaf once there)."""
    return [
        chunk_keys(ns, list(range(i * 100, i * 100 + SPEC.chunk_tokens)))[0]
        for i in range(start, start + n)
    ]


def ssd_bytes(store: TieredStore) -> dict[str, int]:
    store.flush()
    return store.stats().tier("ssd").tenant_bytes


def disk_live_bytes(store: TieredStore) -> int:
    disk = store._state.tiers[-1]
    assert isinstance(disk, DiskTier)
    return disk.stats().live_bytes


def test_a_tenant_flooding_the_ssd_evicts_its_own_records_not_anothers(tmp_path: Path) -> None:
    """B's six chunks reach the SSD first; A then demotes 60 chunks through a 24-record SSD
    with a quota of 8 records (a maintenance pass after each put, as the daemon's thread
    runs them: compaction gives dead records' space back): A's oldest SSD records go, B's
    all stay, and A never holds more than its quota.

    Regression: on the old code an SSD quota was refused, and without one A's flood filled
    the SSD and the full disk evicted the least recently used leaves, B's first."""
    store = make_store(tmp_path, {"team-a": {"ssd": 8 * RECORD}})
    try:
        b_keys = prompts(NS_B, 6, 1000)
        for key in b_keys:
            assert store.put(NS_B, key, payload(key))
        a_keys = prompts(NS_A, 60)
        for key in a_keys:
            assert store.put(NS_A, key, payload(key))
            assert ssd_bytes(store)["team-a"] <= 8 * RECORD
            store.maintain()
        assert ssd_bytes(store) == {"team-a": 8 * RECORD, "team-b": 6 * RECORD}
        for key in b_keys:  # every one still there, byte-exact, read back from SSD
            assert store.tier_of(NS_B, key) == "ssd"
            with store.get(NS_B, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
        kept = [key for key in a_keys if store.contains(NS_A, key)]
        on_ssd = [key for key in kept if store.tier_of(NS_A, key) == "ssd"]
        assert len(on_ssd) == 8 and kept == a_keys[-len(kept) :]  # the oldest went
        stats = store.stats()
        assert stats.tier("ssd").evictions == 60 - len(kept)  # every one through the SSD
        assert stats.tier("dram").evictions == stats.tier("ssd").quota_refused_demotions == 0
    finally:
        store.close()


def test_a_tenant_with_a_quota_that_finds_the_disk_full_gives_up_its_own_records(
    tmp_path: Path,
) -> None:
    """Without compaction A's own dead records fill the 24-record SSD: a full disk then
    costs A its own SSD leaves (and the chunk it was demoting), never B's.

    Regression: the full-disk path evicted the SSD's least recently used leaves, whoever's
    they were: B's, the oldest, first."""
    store = make_store(tmp_path, {"team-a": {"ssd": 8 * RECORD}})
    try:
        b_keys = prompts(NS_B, 6, 1000)
        for key in b_keys:
            assert store.put(NS_B, key, payload(key))
        for key in prompts(NS_A, 60):
            assert store.put(NS_A, key, payload(key))
        assert store.stats().tier("ssd").used_bytes > 20 * RECORD  # dead records mostly
        assert all(store.tier_of(NS_B, key) == "ssd" for key in b_keys)
        assert ssd_bytes(store)["team-b"] == 6 * RECORD
        assert ssd_bytes(store)["team-a"] <= 8 * RECORD
    finally:
        store.close()


def test_a_record_over_the_whole_quota_is_evicted_from_memory_and_counted(tmp_path: Path) -> None:
    """A quota smaller than one record: A's victims leave DRAM without an SSD write (each
    counted in DRAM's evictions and the SSD tier's ``quota_refused_demotions``), and A's
    SSD bytes stay 0; B, without a quota, demotes as before."""
    store = make_store(tmp_path, {"team-a": {"ssd": "8KiB"}})
    try:
        for key in prompts(NS_A, 10):
            assert store.put(NS_A, key, payload(key))
        for key in prompts(NS_B, 5, 1000):
            assert store.put(NS_B, key, payload(key))
        stats = store.stats()
        assert stats.tier("ssd").quota_refused_demotions == 6 + 4  # A's: all of them
        assert stats.tier("dram").evictions == 10
        assert ssd_bytes(store) == {"team-a": 0, "team-b": RECORD}
        assert stats.tier("ssd").objects == 1
    finally:
        store.close()


def test_ssd_bytes_per_tenant_stay_exact_and_survive_a_restart(tmp_path: Path) -> None:
    """Demotions, reads back (the record kept as a copy), deletes and evictions: the tenants'
    SSD bytes always add up to the records the SSD holds live; a restart re-indexes the
    segments and finds the same figures (the tenant comes from each record's metadata);
    when every object is gone they are 0.

    Regression: a charge missed on any of these paths leaves a tenant over (or under) its
    quota for good; one counted from the namespace table instead of the records would read
    0 after the restart."""
    quotas = {"team-a": {"ssd": 10 * RECORD}, "team-b": {"ssd": "50%"}}
    store = make_store(tmp_path, quotas)
    a_keys, b_keys = prompts(NS_A, 9), prompts(NS_B, 7, 1000)
    try:
        for key in a_keys + b_keys:
            assert store.put(NS_A if key in a_keys else NS_B, key, payload(key))
        usage = ssd_bytes(store)
        assert sum(usage.values()) == disk_live_bytes(store) == 12 * RECORD
        for key in a_keys[:3]:  # read back: promoted, the record stays as a copy
            with store.get(NS_A, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
        assert sum(ssd_bytes(store).values()) == disk_live_bytes(store)
        assert store.delete(NS_A, a_keys[0]) and store.delete(NS_B, b_keys[0])
        store.evict("ssd", RECORD)
        assert sum(ssd_bytes(store).values()) == disk_live_bytes(store)
        before = ssd_bytes(store)
    finally:
        store.close()  # writes what memory holds down to SSD first
    after_close = None
    store = make_store(tmp_path, quotas)
    try:
        after_close = store.stats().tier("ssd").tenant_bytes
        assert sum(after_close.values()) == disk_live_bytes(store)
        assert after_close["team-a"] >= before["team-a"] and after_close["team-b"] > 0
        left = [
            (ns, key)
            for ns, chain in ((NS_A, a_keys), (NS_B, b_keys))
            for key in chain
            if store.contains(ns, key)
        ]
        assert sum(after_close.values()) == len(left) * RECORD
        for ns, key in left:
            assert store.delete(ns, key)
        assert ssd_bytes(store) == {"team-a": 0, "team-b": 0}
    finally:
        store.close()
