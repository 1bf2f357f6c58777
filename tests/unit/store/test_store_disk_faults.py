"""TieredStore over an SSD tier that fails: a full disk (a real tmpfs the test mounts and
fills), a record compaction finds corrupt, and crashes after chunks were read back.

What must hold: puts never fail because of the disk; what the SSD held stays readable
byte-exact; the store says it is degraded; memory evicts (counted) instead of demoting;
it recovers by itself when space returns; a chunk read back from SSD keeps its record
until the SSD needs the space, so a crash after the read does not lose it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from small_fs import fill_blocks, tmpfs

from kvfabric.errors import NotFoundError
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind
from kvfabric.tiers.disk import ALIGN, DiskTier

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("faults", SPEC)
CHUNK = SPEC.chunk_bytes  # 32 KiB
SPAN = ALIGN + CHUNK  # one SSD record
PAGE = 4096
MiB = 1 << 20


def key_of(i: int) -> bytes:
    return (i + 1).to_bytes(16, "little")


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, CHUNK, dtype=np.uint8
    )


def put_keys(store: TieredStore, indices: range) -> list[bytes]:
    keys = [key_of(i) for i in indices]
    for key in keys:
        assert store.put(NS, key, payload(key)) is True  # never an error
    return keys


def read(store: TieredStore, key: bytes) -> bytes:
    with store.get(NS, key) as reader:
        return reader.to_bytes()


def make_store(
    data_dir: Path, *, ssd_capacity: int = 64 * MiB, segment_bytes: int = MiB, **policy: object
) -> TieredStore:
    tiers = (
        TierConfig(TierKind.DRAM, 16 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.SSD, ssd_capacity, path="ssd", segment_bytes=segment_bytes),
    )
    config = StoreConfig(data_dir=str(data_dir), tiers=tiers, **policy)  # type: ignore[arg-type]
    return TieredStore(config, maintenance=False)


def disk_of(store: TieredStore) -> DiskTier:
    disk = store._state.disk()
    assert disk is not None
    return disk


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", size="8m", inodes=64) as path:
        yield path


def test_full_disk_degrades_the_ssd_tier_and_no_put_fails(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: on the old code, with the disk full, puts failed with raw OSErrors
    (``internal`` on the wire), the SSD tier's used_bytes leaked towards its capacity, which
    then evicted the objects the SSD already held, and every failed write logged a line."""
    caplog.set_level(logging.WARNING)
    store = make_store(small_fs)
    try:
        first = put_keys(store, range(100))
        store.flush()
        on_ssd = [k for k in first if store.tier_of(NS, k) == "ssd"]
        assert len(on_ssd) >= 80
        filler = fill_blocks(small_fs)

        put_keys(store, range(100, 400))  # asserts each put succeeds
        store.flush()
        store.maintain()
        stats = store.stats()
        ssd, dram = stats.tier("ssd"), stats.tier("dram")
        assert stats.degraded_tiers == ("ssd",) and store.degraded_tiers == ["ssd"]
        assert ssd.disk_errors.get("ENOSPC", 0) >= 1
        assert ssd.refused_demotions > 200 and dram.evictions >= ssd.refused_demotions
        assert ssd.objects == len(on_ssd) and ssd.evictions == 0  # the SSD lost nothing
        disk = disk_of(store).stats()
        assert disk.used_bytes == disk.live_bytes == len(on_ssd) * SPAN  # exact, no leak
        assert disk.segments <= 6
        for key in on_ssd:  # still readable (and read back into memory) while degraded
            assert read(store, key) == payload(key).tobytes()
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) <= 2, [r.getMessage() for r in warnings]

        os.unlink(filler)
        time.sleep(1.05)  # the tier's default retry interval
        store.maintain()
        assert store.degraded_tiers == [] and not store.stats().tier("ssd").degraded
        writes = disk_of(store).stats().writes
        newer = put_keys(store, range(400, 440))
        store.flush()
        assert disk_of(store).stats().writes > writes  # demotions land on the SSD again
        assert any(store.tier_of(NS, k) == "ssd" for k in newer)
        for key in on_ssd:
            assert read(store, key) == payload(key).tobytes()
    finally:
        store.close()


def test_a_chunk_read_back_from_ssd_survives_a_crash(tmp_path: Path) -> None:
    """Regression: on the old code reading a chunk back from SSD marked its record DEAD, so
    a crash afterwards (memory lost, nothing spilled) lost the chunk, although SSD contents
    are promised to survive; and demoting it again wrote it a second time."""
    store = make_store(tmp_path, persist_on_close=False)  # close() then loses memory: a crash
    keys = put_keys(store, range(24))
    store.flush()
    key = next(k for k in keys if store.tier_of(NS, k) == "ssd")
    assert read(store, key) == payload(key).tobytes()
    assert store.tier_of(NS, key) == "dram"  # promoted on the read

    # pushed out of memory again: it goes back to the record it kept, nothing is written
    before = store.stats().tier("dram").demotions, disk_of(store).stats().writes
    put_keys(store, range(100, 116))
    store.flush()
    assert store.tier_of(NS, key) == "ssd"
    demoted = store.stats().tier("dram").demotions - before[0]
    written = disk_of(store).stats().writes - before[1]
    assert demoted == written + 1
    assert read(store, key) == payload(key).tobytes()  # promoted a second time
    assert store.tier_of(NS, key) == "dram"
    store.close()

    store = make_store(tmp_path, persist_on_close=False)
    try:
        assert store.tier_of(NS, key) == "ssd"
        assert read(store, key) == payload(key).tobytes()
    finally:
        store.close()


def test_a_deleted_chunk_does_not_come_back_from_its_kept_copy(tmp_path: Path) -> None:
    """A read-back chunk keeps its SSD record (see above); deleting the chunk must kill that
    record at once, even while a reader still pins the memory copy, or a crash would bring
    the deleted chunk back."""
    store = make_store(tmp_path, persist_on_close=False)
    keys = put_keys(store, range(24))
    store.flush()
    key = next(k for k in keys if store.tier_of(NS, k) == "ssd")
    reader = store.get(NS, key)  # read back into memory, and still pinned
    assert store.delete(NS, key)
    live = disk_of(store).stats().records_live
    store.close()  # a crash: memory lost, the pin never released
    del reader
    store = make_store(tmp_path, persist_on_close=False)
    try:
        assert not store.contains(NS, key)
        assert len(store) == live
    finally:
        store.close()


def test_kept_copies_are_the_first_ssd_space_given_up(tmp_path: Path) -> None:
    """Regression: on the old code a read-back chunk's record was dead at once (the promise
    above broken); the copies it now keeps must not cost the SSD any object: when the SSD
    needs space, copies go before any SSD-only object is evicted."""
    store = make_store(tmp_path, ssd_capacity=12 * SPAN, high_watermark=1.0, low_watermark=0.9)
    try:
        put_keys(store, range(26))
        store.flush()
        on_ssd = [k for k in map(key_of, range(26)) if store.tier_of(NS, k) == "ssd"]
        assert len(on_ssd) == 10
        for key in on_ssd[:2]:  # read back: in memory, with their records kept
            assert read(store, key) == payload(key).tobytes()
        store.flush()
        assert len(store._placement._residency.copies) == 2
        assert disk_of(store).used_bytes == 12 * SPAN  # full: 8 + 2 copies + 2 demoted
        put_keys(store, range(100, 102))  # their victims need SSD space
        store.flush()
        stats = store.stats()
        assert stats.tier("ssd").evictions == 0  # the copies went, not SSD objects
        assert len(store._placement._residency.copies) == 0
        assert stats.tier("ssd").objects == 10
        for key in on_ssd[:2]:
            assert store.tier_of(NS, key) == "dram"
    finally:
        store.close()


def test_a_record_compaction_finds_corrupt_leaves_the_index(tmp_path: Path) -> None:
    """Regression: on the old code compaction skipped the corrupt record and unlinked its
    segment, but the index kept the object: it was still listed (contains, lookups) and
    every read failed with ``stale_extent``, for good."""
    store = make_store(tmp_path, segment_bytes=4 * SPAN)  # four records per segment
    try:
        put_keys(store, range(28))
        store.flush()
        index_ns = store._namespaces[NS.seed]
        in_first = [
            k
            for k in map(key_of, range(28))
            if store.tier_of(NS, k) == "ssd"
            and store._state.index.find(index_ns, k).handle.segment_id == 1
        ]  # type: ignore
        assert len(in_first) == 4
        for key in in_first[:3]:
            assert store.delete(NS, key)
        bad = in_first[3]
        extent = store._state.index.find(index_ns, bad).handle  # type: ignore[union-attr]
        with open(tmp_path / "ssd" / "seg-00000001.kvf", "r+b") as f:
            f.seek(extent.payload_offset + 64)
            f.write(b"\x00\xff" * 8)
        store.maintain()  # compacts segment 1 (3 of 4 records dead)
        assert not (tmp_path / "ssd" / "seg-00000001.kvf").exists()
        assert not store.contains(NS, bad)
        assert store.lookup(NS, [bad]).matched_chunks == 0
        with pytest.raises(NotFoundError):
            read(store, bad)
        assert store.stats().tier("ssd").corrupt_records == 1
    finally:
        store.close()
