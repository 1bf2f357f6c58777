"""Unit tests for DiskTier: round trips, restart, corruption, capacity, compaction, paths."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from kvfabric.errors import CapacityError, ConfigError, CorruptRecordError, KVFabricError
from kvfabric.tiers.disk import (
    ALIGN,
    DiskExtent,
    DiskTier,
    RecordFieldError,
    RecoveredRecord,
    StaleExtentError,
    TierDegradedError,
)
from kvfabric.tiers.disk import segments as seg_mod
from kvfabric.tiers.disk.records import DEAD, STATE_OFFSET
from kvfabric.tiers.disk.tier import HASH_BATCH

MiB = 1 << 20


class Tiers:
    """Opens (and scans) tiers on one directory; closes all of them at teardown."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.opened: list[DiskTier] = []

    def open(self, **kwargs: object) -> tuple[DiskTier, list[RecoveredRecord]]:
        kwargs.setdefault("capacity_bytes", 64 * MiB)
        tier = DiskTier(self.directory, **kwargs)  # type: ignore[arg-type]
        self.opened.append(tier)
        return tier, tier.scan()


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Tiers]:
    t = Tiers(tmp_path / "disk")
    yield t
    for tier in t.opened:
        tier.close()


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def split(buf: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] == len(buf)
    return [buf[a:b] for a, b in itertools.pairwise(bounds)]


def read_back(tier: DiskTier, extent: DiskExtent, sizes: list[int] | None = None) -> bytes:
    out = np.full(extent.payload_len, 0xAA, dtype=np.uint8)
    tier.read_into(extent, split(out, sizes or [extent.payload_len]))
    return out.tobytes()


def put(tier: DiskTier, i: int, n: int) -> DiskExtent:
    return tier.write(key_of(i), f"m{i}".encode(), [payload(n, i)]).result()


def expected(i: int, n: int) -> bytes:
    return payload(n, i).tobytes()


def seg_file(directory: Path, segment_id: int) -> Path:
    return directory / seg_mod.segment_name(segment_id)


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ mask]))


def by_key(records: list[RecoveredRecord]) -> dict[bytes, RecoveredRecord]:
    return {r.key: r for r in records}


# ---- round trips and restart ---------------------------------------------------------


def test_scatter_gather_round_trip_with_odd_piece_sizes(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    data = payload(4096 + 1000 + 77, 1)
    extent = tier.write(
        key_of(1), b"meta", [data[:4096].data, data[4096:5096], data[5096:]]
    ).result()
    assert extent.payload_len == 5173 and extent.offset % ALIGN == 0
    assert extent.payload_offset == extent.offset + ALIGN
    assert read_back(tier, extent, [77, 4096, 1000]) == data.tobytes()
    assert read_back(tier, extent) == data.tobytes()
    # More pieces than IOV_MAX on both paths still land byte-exact.
    many = payload(3 * 2000 + 5, 2)
    ext2 = tier.write(key_of(2), b"", split(many, [3] * 2000 + [5])).result()
    assert read_back(tier, ext2, [5] + [3] * 2000) == many.tobytes()
    s = tier.stats()
    assert (s.writes, s.reads, s.records_live, s.corrupt_records) == (2, 3, 2, 0)
    assert s.used_bytes == s.live_bytes == tier.used_bytes == 2 * ALIGN + 8192 + 8192
    assert s.bytes_read == 2 * 5173 + len(many)


def test_multidimensional_readonly_and_mismatched_pieces(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    data = payload(6000, 3).view(np.uint16).reshape(2, 1500)
    extent = tier.write(key_of(3), b"", [data, memoryview(b"tail")]).result()
    assert read_back(tier, extent) == data.tobytes() + b"tail"
    with pytest.raises(RecordFieldError):  # read buffers must be writable
        tier.read_into(extent, [memoryview(bytes(extent.payload_len))])
    with pytest.raises(ValueError):  # total length must equal payload_len
        tier.read_into(extent, [np.zeros(extent.payload_len - 1, np.uint8)])
    with pytest.raises(RecordFieldError):
        tier.write(key_of(4), b"", [np.zeros((4, 4), np.uint8)[:, ::2]])
    with pytest.raises(RecordFieldError):
        tier.write(b"short", b"", [])
    with pytest.raises(RecordFieldError):
        tier.write(key_of(5), b"m" * 4000, [])


def test_zero_length_payload_round_trip_and_restart(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    e1 = tier.write(key_of(1), b"empty", []).result()
    e2 = tier.write(key_of(2), b"empty2", [np.zeros(0, np.uint8)]).result()
    assert e1.payload_len == e2.payload_len == 0 and e2.offset == e1.offset + ALIGN
    tier.read_into(e1, [])
    tier.read_into(e2, [np.zeros(0, np.uint8)])
    tier.close()
    _, recs = tiers.open()
    assert by_key(recs) == {
        key_of(1): RecoveredRecord(key_of(1), b"empty", e1),
        key_of(2): RecoveredRecord(key_of(2), b"empty2", e2),
    }


def test_restart_recovers_the_same_records(tiers: Tiers) -> None:
    tier, recs = tiers.open(writers=3, segment_bytes=64 * ALIGN)
    assert recs == []
    sizes = {i: int(n) for i, n in enumerate(np.random.default_rng(0).integers(0, 50_000, 60))}
    futures = {
        i: tier.write(key_of(i), f"m{i}".encode(), [payload(n, i)]) for i, n in sizes.items()
    }
    tier.flush()
    assert all(f.done() for f in futures.values())
    extents = {i: f.result() for i, f in futures.items()}
    offsets = sorted((e.segment_id, e.offset) for e in extents.values())
    assert len(set(offsets)) == 60  # no two writers overlapped
    before = tier.stats()
    tier.close()
    tier.close()  # idempotent
    tier2, recs = tiers.open(writers=2)
    found = by_key(recs)
    assert set(found) == {key_of(i) for i in sizes}
    for i, n in sizes.items():
        rec = found[key_of(i)]
        assert rec.meta == f"m{i}".encode() and rec.extent == extents[i]
        assert read_back(tier2, rec.extent, [n // 3, n - n // 3]) == expected(i, n)
    after = tier2.stats()
    assert (after.used_bytes, after.live_bytes, after.records_live) == (
        before.used_bytes,
        before.live_bytes,
        60,
    )
    # New writes go to a fresh segment, never after the old tail.
    assert put(tier2, 100, 10).segment_id > max(e.segment_id for e in extents.values())


def test_delete_is_idempotent_and_survives_restart(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    e1, e2 = put(tier, 1, 5000), put(tier, 2, 100)
    tier.delete(e1)
    s = tier.stats()
    assert (s.records_live, s.dead_bytes, s.live_bytes) == (1, e1.span, e2.span)
    tier.delete(e1)
    assert tier.stats() == s
    with pytest.raises(StaleExtentError):
        read_back(tier, e1)
    tier.close()
    tier2, recs = tiers.open()
    assert [r.key for r in recs] == [key_of(2)]
    assert tier2.stats().dead_bytes == e1.span
    tier2.delete(e1)  # still a no-op after restart
    assert tier2.stats().records_live == 1


def test_duplicate_live_key_last_write_wins_and_loser_marked_dead(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    old = tier.write(key_of(7), b"v1", [payload(100, 1)]).result()
    new = tier.write(key_of(7), b"v2", [payload(200, 2)]).result()
    tier.close()
    tier2, recs = tiers.open()
    assert recs == [RecoveredRecord(key_of(7), b"v2", new)]
    data = seg_file(tier2.path, old.segment_id).read_bytes()
    assert data[old.offset + STATE_OFFSET] == DEAD
    assert tier2.stats().dead_bytes == old.span


def test_stale_and_bogus_extents(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    e = put(tier, 1, 100)
    with pytest.raises(StaleExtentError):
        tier.read_into(e, [np.zeros(100, np.uint8)], key=key_of(2))
    with pytest.raises(StaleExtentError):
        read_back(tier, DiskExtent(e.segment_id, e.offset, e.payload_offset, 99))
    with pytest.raises(StaleExtentError):
        read_back(tier, DiskExtent(e.segment_id, e.offset + 1, e.payload_offset + 1, 100))
    with pytest.raises(StaleExtentError):
        read_back(tier, DiskExtent(999, e.offset, e.payload_offset, 100))
    with pytest.raises(StaleExtentError):  # no record starts there
        tier.delete(DiskExtent(e.segment_id, e.offset + ALIGN, e.payload_offset + ALIGN, 0))
    assert read_back(tier, e) == expected(1, 100)
    assert tier.stats().corrupt_records == 0


# ---- corruption and crashes ----------------------------------------------------------


def test_flipped_payload_byte_is_refused_counted_and_never_served(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    e1, e2 = put(tier, 1, 10_000), put(tier, 2, 10_000)
    flip_byte(seg_file(tier.path, e1.segment_id), e1.payload_offset + 1234, 0x01)
    with pytest.raises(CorruptRecordError, match="checksum"):
        read_back(tier, e1)
    s = tier.stats()
    assert s.corrupt_records == 1 and s.records_live == 1 and s.dead_bytes == e1.span
    with pytest.raises(StaleExtentError):  # marked DEAD: never served again
        read_back(tier, e1)
    assert read_back(tier, e2) == expected(2, 10_000)
    tier.close()
    _, recs = tiers.open()
    assert [r.key for r in recs] == [key_of(2)]


def test_reads_in_hash_batches_land_exact_and_check_every_batch(tiers: Tiers) -> None:
    # A payload over several read-and-hash batches, pieces straddling the batch bounds.
    n = 2 * HASH_BATCH + 12_345
    tier, _ = tiers.open()
    e1, e2 = put(tier, 1, n), put(tier, 2, n)
    sizes = [HASH_BATCH - 100, 200, HASH_BATCH + 5_000, n - 2 * HASH_BATCH - 5_100]
    assert read_back(tier, e1, sizes) == expected(1, n)
    assert read_back(tier, e1) == expected(1, n)
    flip_byte(seg_file(tier.path, e2.segment_id), e2.payload_offset + HASH_BATCH + 7, 0x10)
    with pytest.raises(CorruptRecordError, match="checksum"):
        read_back(tier, e2, sizes)  # a flip in the second batch, not only the first
    assert tier.stats().corrupt_records == 1


def test_truncated_tail_is_torn_and_earlier_records_intact(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    extents = [put(tier, i, 9000) for i in range(3)]
    tier.close()
    os.truncate(seg_file(tiers.directory, 1), extents[2].payload_offset + 100)
    tier2, recs = tiers.open()
    assert [r.extent for r in recs] == extents[:2]
    for i in range(2):
        assert read_back(tier2, extents[i]) == expected(i, 9000)
    s = tier2.stats()
    assert (s.torn_records, s.corrupt_records, s.records_live) == (1, 0, 2)
    assert put(tier2, 9, 10).segment_id == 2  # never appends after the torn tail


def test_flipped_header_byte_in_middle_record_hides_only_that_record(tiers: Tiers) -> None:
    tier, _ = tiers.open()
    extents = [put(tier, i, 5000 + i) for i in range(3)]
    tier.close()
    flip_byte(seg_file(tiers.directory, 1), extents[1].offset + 20)  # inside the key
    tier2, recs = tiers.open()
    assert [r.key for r in recs] == [key_of(0), key_of(2)]
    assert read_back(tier2, extents[2]) == expected(2, 5002)
    assert tier2.stats().corrupt_records == 1
    with pytest.raises(CorruptRecordError):
        read_back(tier2, extents[1])


def test_write_io_error_lands_on_the_future_and_writer_survives(
    tiers: Tiers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error degrades the tier until a probe succeeds, and the failed record gives
    its space back (the old code kept it: used_bytes was twice the live bytes here)."""
    tier, _ = tiers.open(writers=1, retry_interval_s=0.0)
    real = seg_mod.SegmentFile.writev
    calls = []

    def flaky(self: seg_mod.SegmentFile, views: list[memoryview], offset: int) -> None:
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EIO, "injected")
        real(self, views, offset)

    monkeypatch.setattr(seg_mod.SegmentFile, "writev", flaky)
    failed = tier.write(key_of(1), b"", [payload(100, 1)])
    assert isinstance(failed.exception(), TierDegradedError)
    assert isinstance(failed.exception().__cause__, OSError)
    assert tier.degraded and tier.stats().disk_errors == {"EIO": 1}
    with pytest.raises(TierDegradedError):
        tier.write(key_of(2), b"", [payload(100, 2)])
    assert tier.probe() and not tier.degraded
    ok = put(tier, 2, 100)
    assert read_back(tier, ok) == expected(2, 100)
    s = tier.stats()
    assert (s.records_live, s.writes, s.live_bytes, s.used_bytes) == (1, 1, ok.span, ok.span)
    tier.close()
    _, recs = tiers.open()
    assert [r.key for r in recs] == [key_of(2)]


# ---- capacity and segments -----------------------------------------------------------


def test_capacity_exceeded_raises_early_and_keeps_data(tiers: Tiers) -> None:
    span = ALIGN + 8192
    tier, _ = tiers.open(capacity_bytes=3 * span)
    extents = [put(tier, i, 8192) for i in range(3)]
    with pytest.raises(CapacityError):
        tier.write(key_of(9), b"", [payload(8192, 9)])  # synchronous, not on the future
    with pytest.raises(CapacityError):
        tier.write(key_of(10), b"", [])
    assert tier.used_bytes == tier.capacity_bytes == 3 * span
    for i, e in enumerate(extents):
        assert read_back(tier, e) == expected(i, 8192)
    assert tier.stats().writes == 3


def test_compaction_regains_capacity_even_when_full(tiers: Tiers) -> None:
    span = ALIGN + 8192
    tier, _ = tiers.open(capacity_bytes=3 * span, segment_bytes=2 * span)
    owner = Owner()
    for i in range(3):  # 0 and 1 fill segment 1, 2 goes to segment 2
        owner.extents[key_of(i)] = put(tier, i, 8192)
    owner.delete(tier, key_of(0))
    with pytest.raises(CapacityError):  # deleting alone does not free segment space
        put(tier, 3, 8192)
    # The copy of record 1 overshoots capacity for a moment; unlinking segment 1 frees two.
    assert tier.compact(owner.relocate) == span
    assert tier.used_bytes == 2 * span
    owner.extents[key_of(3)] = put(tier, 3, 8192)
    for i in (1, 2, 3):
        assert read_back(tier, owner.extents[key_of(i)]) == expected(i, 8192)


def test_fsync_mode_round_trip(tiers: Tiers) -> None:
    tier, _ = tiers.open(fsync=True, segment_bytes=4 * ALIGN)
    owner = Owner()
    for i in range(4):
        owner.extents[key_of(i)] = put(tier, i, 4096)
    owner.delete(tier, key_of(0))
    assert tier.compact(owner.relocate) == 8192
    tier.close()
    tier2, recs = tiers.open(fsync=True)
    assert {r.key: r.extent for r in recs} == owner.extents
    for i in (1, 2, 3):
        assert read_back(tier2, owner.extents[key_of(i)]) == expected(i, 4096)


def test_segment_roll_over(tiers: Tiers) -> None:
    tier, _ = tiers.open(segment_bytes=4 * ALIGN)
    extents = [put(tier, i, 4096) for i in range(5)]  # span 8 KiB: two per segment
    big = put(tier, 5, 5 * ALIGN)  # larger than a segment: gets one of its own
    assert [e.segment_id for e in extents] == [1, 1, 2, 2, 3]
    assert big.segment_id == 4 and big.offset == 0
    assert sorted(p.name for p in tier.path.iterdir()) == [
        seg_mod.segment_name(i) for i in range(1, 5)
    ]
    assert tier.stats().segments == 4
    tier.close()
    tier2, recs = tiers.open(segment_bytes=4 * ALIGN)
    assert [r.extent for r in recs] == [*extents, big]
    assert read_back(tier2, big) == expected(5, 5 * ALIGN)


# ---- compaction ----------------------------------------------------------------------


class Owner:
    """A minimal stand-in for the store's index: key -> extent, answered under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.extents: dict[bytes, DiskExtent] = {}
        self.calls: list[tuple[bytes, DiskExtent, DiskExtent]] = []
        self.refuse: set[bytes] = set()

    def relocate(self, key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
        with self.lock:
            self.calls.append((key, old, new))
            if key in self.refuse or self.extents.get(key) != old:
                return False
            self.extents[key] = new
            return True

    def delete(self, tier: DiskTier, key: bytes) -> None:
        with self.lock:
            extent = self.extents.pop(key)
        tier.delete(extent)


def test_compaction_reclaims_space_and_relocates(tiers: Tiers) -> None:
    tier, _ = tiers.open(segment_bytes=8 * ALIGN)  # four 8 KiB records per segment
    owner = Owner()
    for i in range(12):
        owner.extents[key_of(i)] = put(tier, i, 4096)
    for i in (0, 1, 2, 4, 5):  # segment 1: 3/4 dead, segment 2: 2/4 dead, 3 is active
        owner.delete(tier, key_of(i))
    seg1 = seg_file(tier.path, 1)
    used = tier.used_bytes
    assert tier.compact(owner.relocate, min_dead_ratio=0.6) == 3 * 8192
    assert tier.used_bytes == used - 3 * 8192 and not seg1.exists()
    ((key, old, new),) = owner.calls
    assert key == key_of(3) and old.segment_id == 1 and new.segment_id == 4
    assert owner.extents[key] == new and read_back(tier, new) == expected(3, 4096)
    with pytest.raises(StaleExtentError):
        read_back(tier, old)
    # Segment 2 next; the owner refuses one copy (as if deleted meanwhile).
    owner.refuse.add(key_of(6))
    assert tier.compact(owner.relocate, min_dead_ratio=0.5) == 2 * 8192
    assert tier.stats().compactions == 2 and not seg_file(tier.path, 2).exists()
    for i in (3, 7, 8, 9, 10, 11):
        assert read_back(tier, owner.extents[key_of(i)]) == expected(i, 4096)
    s = tier.stats()
    assert s.records_live == 6 and s.dead_bytes == 8192  # the refused copy
    tier.close()
    _, recs = tiers.open()
    assert {r.key: r.extent for r in recs} == {
        k: e for k, e in owner.extents.items() if k != key_of(6)
    }


def test_compaction_copy_never_beats_a_newer_write(tiers: Tiers, tmp_path: Path) -> None:
    tier, _ = tiers.open(segment_bytes=4 * ALIGN)
    v1 = tier.write(key_of(1), b"v1", [payload(10, 1)]).result()
    other = put(tier, 2, 10)
    v2 = tier.write(key_of(1), b"v2", [payload(10, 2)]).result()  # overwrite, segment 2
    tier.delete(other)
    snap = tmp_path / "snap"

    def crash_here(key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
        shutil.copytree(tier.path, snap)  # the disk as a crash right now would leave it
        return False

    tier.compact(crash_here, min_dead_ratio=0.5)
    assert (v1.segment_id, v2.segment_id) == (1, 2)
    crashed = DiskTier(snap, capacity_bytes=MiB)
    try:
        recs = crashed.scan()  # v1, its compaction copy (same sequence) and v2 are all LIVE
        assert [(r.key, r.meta, r.extent) for r in recs] == [(key_of(1), b"v2", v2)]
    finally:
        crashed.close()


def test_a_torn_compaction_copy_never_beats_its_intact_original(
    tiers: Tiers, tmp_path: Path
) -> None:
    """A crash mid-copy while a later record lands past the copy (the daemon compacts while
    it demotes): the copy's header is whole and its span inside the file, its payload not.
    Regression: recovery took the copy (same sequence, newer segment), marked the intact
    original DEAD and then refused the copy: an acknowledged object lost."""
    tier, _ = tiers.open(segment_bytes=16 * ALIGN)
    original = put(tier, 1, 2 * ALIGN)  # 3 pages at the start of segment 1
    tier.delete(put(tier, 2, 10))  # 2 dead pages: segment 1 is worth compacting
    put(tier, 3, 11 * ALIGN)  # 12 pages: segment 2 opens, segment 1 is sealed
    snap, copies = tmp_path / "snap", []
    tier.flush()  # every write settled: segment 1 may be compacted

    def crash_mid_copy(key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
        copies.append(new)
        put(tier, 4, 0)  # one page past the copy, in the same segment
        shutil.copytree(tier.path, snap)  # the disk as a crash right now would leave it
        return True

    tier.compact(crash_mid_copy, min_dead_ratio=0.3)
    (copy,) = copies
    assert (original.segment_id, copy.segment_id) == (1, 2)
    # tear the copy: its last payload page never reached the page cache (a hole)
    with open(seg_file(snap, copy.segment_id), "r+b") as f:
        f.seek(copy.payload_offset + ALIGN)
        f.write(bytes(ALIGN))
    crashed = DiskTier(snap, capacity_bytes=MiB)
    try:
        recs = by_key(crashed.scan())
        assert recs[key_of(1)].extent == original
        assert read_back(crashed, original) == expected(1, 2 * ALIGN)
        assert recs.keys() == {key_of(1), key_of(3), key_of(4)}
    finally:
        crashed.close()


def test_compaction_waits_until_the_owner_has_heard_of_a_write(tiers: Tiers) -> None:
    """The owner learns a record's extent in its write future's done callback (the store
    does). Regression: a segment whose last write had finished but whose callbacks had not
    run yet was compacted: relocate, asked about a record its owner did not know, said "not
    wanted", the record was deleted and its segment unlinked, then the owner adopted an
    extent that was gone (an acknowledged SSD object lost; seen in the SIGKILL crash test)."""
    tier, _ = tiers.open(segment_bytes=16 * MiB, writers=2)
    tier.delete(put(tier, 1, 10))  # dead bytes: segment 1 is worth compacting
    owner = Owner()
    entered, release, learnt = threading.Event(), threading.Event(), threading.Event()

    inline: list[Future[DiskExtent]] = []

    def learn(future: Future[DiskExtent]) -> None:
        if threading.current_thread() is threading.main_thread():
            inline.append(future)  # the write ended before the callback was added
            return
        entered.set()
        release.wait(10)
        with owner.lock:
            owner.extents[key_of(2)] = future.result()
        learnt.set()

    for _ in range(5):  # an 8 MiB write is still in flight when the callback is added
        future = tier.write(key_of(2), b"m2", [payload(8 * MiB, 2)])
        future.add_done_callback(learn)
        if not inline:
            break
        tier.delete(inline.pop().result())
    else:
        pytest.fail("every write ended before its callback was added")
    assert entered.wait(10)
    try:
        assert future.done()  # the owner has not heard of it yet: its callback is blocked
        put(tier, 3, 12 * MiB)  # does not fit: segment 2 opens, segment 1 is sealed
        assert tier.compact(owner.relocate, min_dead_ratio=0.0) == 0
    finally:
        release.set()
    assert learnt.wait(10)
    assert read_back(tier, owner.extents[key_of(2)]) == expected(2, 8 * MiB)
    assert tier.compact(owner.relocate, min_dead_ratio=0.0) > 0  # now it may
    assert read_back(tier, owner.extents[key_of(2)]) == expected(2, 8 * MiB)


def test_compaction_concurrent_with_reads_never_yields_wrong_bytes(tiers: Tiers) -> None:
    tier, _ = tiers.open(segment_bytes=16 * ALIGN, writers=2)
    owner = Owner()
    sizes = {i: int(n) for i, n in enumerate(np.random.default_rng(5).integers(0, 20_000, 80))}
    for i, n in sizes.items():
        owner.extents[key_of(i)] = put(tier, i, n)
    keep = [i for i in sizes if i % 3 == 0]
    started, compacted, stop = threading.Event(), threading.Event(), threading.Event()
    errors: list[str] = []
    reads_after = [0]

    def reader() -> None:
        rng = np.random.default_rng(9)
        reads = 0
        while not stop.is_set():
            i = keep[int(rng.integers(len(keep)))]
            for _ in range(5):  # a stale extent means the record just moved: look it up again
                with owner.lock:
                    extent = owner.extents[key_of(i)]
                try:
                    got = read_back(tier, extent)
                    break
                except StaleExtentError:
                    continue
            else:
                errors.append(f"key {i}: stale five times in a row")
                return
            if got != expected(i, sizes[i]):
                errors.append(f"key {i}: wrong bytes")
                return
            reads += 1
            if reads == 20:
                started.set()
            if compacted.is_set():
                reads_after[0] += 1
                if reads_after[0] >= 50:
                    return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        assert started.wait(60)
        for i in sizes:
            if i % 3:
                owner.delete(tier, key_of(i))
        reclaimed = tier.compact(owner.relocate, min_dead_ratio=0.3)
        for i in range(100, 120):  # keep writing, then compact again while reads continue
            owner.extents[key_of(i)] = put(tier, i, 3000)
            owner.delete(tier, key_of(i))
        reclaimed += tier.compact(owner.relocate, min_dead_ratio=0.3)
        compacted.set()
        thread.join(60)
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert reads_after[0] >= 50
    assert reclaimed > 0 and tier.stats().compactions >= 2
    for i in keep:
        assert read_back(tier, owner.extents[key_of(i)]) == expected(i, sizes[i])


def test_retired_segment_fd_stays_open_while_pinned(tmp_path: Path) -> None:
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seg = seg_mod.SegmentFile.open(dir_fd, 1, create=True)
        seg.writev([memoryview(b"x" * 100)], 0)
        seg.pin()
        seg_mod.remove_segment(dir_fd, 1)
        seg.retire()
        assert not seg.closed and seg.read(3, 10) == b"xxx"  # an in-flight read still works
        with pytest.raises(KVFabricError):
            seg.pin()
        seg.unpin()
        assert seg.closed and not (tmp_path / seg_mod.segment_name(1)).exists()
    finally:
        os.close(dir_fd)


# ---- configuration and path safety ---------------------------------------------------


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize(
    "case",
    [
        "dotdot",
        "absolute_outside",
        "symlink_out",
        "dangling_symlink_out",
        "regular_file",
        "under_file",
        "nul",
    ],
)
def test_hostile_directories_are_refused(tmp_path: Path, case: str) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "file").write_text("not a directory")
    directory: str = {
        "dotdot": "../escape",
        "absolute_outside": str(outside / "tier"),
        "symlink_out": "link/tier",
        "dangling_symlink_out": "dangling",
        "regular_file": "file",
        "under_file": "file/tier",
        "nul": "bad\x00name",
    }[case]
    (root / "link").symlink_to(outside)
    (root / "dangling").symlink_to(outside / "not-yet")
    before = _tree(tmp_path)
    with pytest.raises(ConfigError):
        DiskTier(directory, capacity_bytes=MiB, root=root)
    assert _tree(tmp_path) == before  # nothing created, inside or outside root


def test_refusals_without_root_and_bad_values(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for directory in (tmp_path / "file", f"{tmp_path}/a\x00b", tmp_path / "file" / "sub"):
        with pytest.raises(ConfigError):
            DiskTier(directory, capacity_bytes=MiB)
    with pytest.raises(ConfigError):
        DiskTier(tmp_path / "d", capacity_bytes=MiB, root=tmp_path / "missing-root")
    for kwargs in (
        {"capacity_bytes": 0},
        {"capacity_bytes": MiB, "segment_bytes": 1000},
        {"capacity_bytes": MiB, "segment_bytes": 0},
        {"capacity_bytes": MiB, "writers": 0},
    ):
        with pytest.raises(ConfigError):
            DiskTier(tmp_path / "d", **kwargs)  # type: ignore[arg-type]


def test_directory_relative_to_root_is_created_private(tmp_path: Path) -> None:
    tier = DiskTier("tiers/ssd", capacity_bytes=MiB, root=tmp_path)
    try:
        assert tier.path == tmp_path.resolve() / "tiers" / "ssd"
        assert stat.S_IMODE(tier.path.stat().st_mode) == 0o700
        with pytest.raises(KVFabricError):  # the owner must scan before writing
            tier.write(key_of(1), b"", [])
        assert tier.scan() == []
        with pytest.raises(KVFabricError):
            tier.scan()
        with pytest.raises(ConfigError):
            tier.compact(lambda k, o, n: True, min_dead_ratio=1.5)
    finally:
        tier.close()
    with pytest.raises(KVFabricError):
        tier.write(key_of(1), b"", [])


def test_stray_and_symlinked_segment_files_are_ignored(tiers: Tiers, tmp_path: Path) -> None:
    tier, _ = tiers.open()
    e = put(tier, 1, 100)
    tier.close()
    real = seg_file(tiers.directory, 1)
    outside = tmp_path / "outside-seg.kvf"
    shutil.copy(real, outside)
    shutil.copy(real, tiers.directory / "seg-evil.kvf")
    shutil.copy(real, tiers.directory / "seg-1.kvf")
    (tiers.directory / "seg-00000099.kvf").symlink_to(outside)
    original = outside.read_bytes()
    tier2, recs = tiers.open()
    # Only the real segment was read: had any copy been opened, key 1 would appear twice
    # and the losing copies would have been marked DEAD.
    assert recs == [RecoveredRecord(key_of(1), b"m1", e)]
    assert tier2.stats().ignored_files == 3 and tier2.stats().segments == 1
    new = put(tier2, 2, 100)
    assert new.segment_id == 100  # never collides with (or writes through) the symlink
    tier2.close()
    assert outside.read_bytes() == original
    assert (tiers.directory / "seg-evil.kvf").read_bytes() == real.read_bytes()[: len(original)]
