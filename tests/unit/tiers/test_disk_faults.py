"""DiskTier under disk faults, on a real small filesystem (a tmpfs the test mounts): a full
disk, no free inode, stray and foreign segment files, a record compaction finds corrupt.

What must hold: the tier degrades (typed error, no raw OSError), what it stored stays
readable byte-exact, ``used_bytes`` matches what the segments really occupy, no segment id
is burned, the log stays quiet, and the tier recovers by itself once space returns.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from small_fs import fill_blocks, fill_inodes, tmpfs

from kvfabric.tiers.disk import ALIGN, DiskExtent, DiskTier, TierDegradedError
from kvfabric.tiers.disk import segments as seg_mod

MiB = 1 << 20
SIZE = 30_000  # a record spans 4 KiB of header + 32 KiB of payload


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def read_back(tier: DiskTier, extent: DiskExtent) -> bytes:
    out = np.zeros(extent.payload_len, dtype=np.uint8)
    tier.read_into(extent, [out])
    return out.tobytes()


def segment_ids(directory: Path) -> list[int]:
    return sorted(int(p.name[4:12]) for p in directory.glob("seg-*.kvf"))


def segment_bytes_on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("seg-*.kvf"))


class Opener:
    """Opens and scans tiers; closes them before the filesystem under them goes."""

    def __init__(self) -> None:
        self.opened: list[DiskTier] = []

    def __call__(self, directory: Path, **kwargs: object) -> DiskTier:
        kwargs.setdefault("capacity_bytes", 64 * MiB)
        kwargs.setdefault("retry_interval_s", 0.0)
        tier = DiskTier(directory, **kwargs)  # type: ignore[arg-type]
        self.opened.append(tier)
        tier.scan()
        return tier

    def close_all(self) -> None:
        for tier in self.opened:
            tier.close()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", size="8m", inodes=64) as path:
        yield path


@pytest.fixture
def open_tier(small_fs: Path) -> Iterator[Opener]:  # after small_fs: closed before unmount
    opener = Opener()
    yield opener
    opener.close_all()


def disk_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("kvfabric.tiers.disk") and r.levelno >= logging.WARNING
    ]


def test_full_disk_degrades_without_losing_leaking_or_flooding(
    small_fs: Path, open_tier: Opener, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: on the old code every write on the full disk raised a raw OSError (the
    store's puts failed as ``internal``), each failed record kept its reservation (used_bytes
    climbed towards the capacity while live bytes stayed put) and a new segment, and so a
    new id, was taken per attempt; the tier never noticed when space came back."""
    caplog.set_level(logging.WARNING)
    directory = small_fs / "ssd"
    tier = open_tier(directory, segment_bytes=1 * MiB, log_interval_s=3600)
    good = {i: tier.write(key_of(i), b"m", [payload(SIZE, i)]).result() for i in range(40)}
    filler = fill_blocks(small_fs)

    # a burst (many writes queued when the first fails), then writes one at a time
    burst: dict[int, Future[DiskExtent]] = {}
    errors: list[BaseException] = []
    for i in range(1000, 1100):
        try:
            burst[i] = tier.write(key_of(i), b"m", [payload(SIZE, i)])
        except TierDegradedError as exc:
            errors.append(exc)
    for i, future in burst.items():
        if future.exception() is None:
            good[i] = future.result()  # a page or two of slack may have taken one
        else:
            errors.append(future.exception())  # type: ignore[arg-type]
    for i in range(2000, 2200):
        try:
            good[i] = tier.write(key_of(i), b"m", [payload(SIZE, i)]).result()
        except TierDegradedError as exc:
            errors.append(exc)
    assert len(errors) >= 290 and all(isinstance(e, TierDegradedError) for e in errors)
    assert tier.degraded and tier.probe() is False  # no space yet

    stats = tier.stats()
    assert stats.degraded and stats.disk_errors.get("ENOSPC", 0) >= 1
    # exact accounting: only the records that landed, and what the files really hold
    assert stats.used_bytes == stats.live_bytes == sum(e.span for e in good.values())
    assert segment_bytes_on_disk(directory) == stats.used_bytes
    assert max(segment_ids(directory)) <= 8  # no id per failed attempt (old code: dozens)
    for i, extent in good.items():
        assert read_back(tier, extent) == payload(SIZE, i).tobytes()
    assert len(disk_warnings(caplog)) <= 1  # one line per log interval, whatever the rate

    os.unlink(filler)
    assert tier.probe() is True and not tier.degraded
    for i in range(3000, 3010):
        good[i] = tier.write(key_of(i), b"m", [payload(SIZE, i)]).result()
    tier.close()
    reopened = open_tier(directory)
    assert reopened.stats().records_live == len(good)
    for i, extent in good.items():
        assert read_back(reopened, extent) == payload(SIZE, i).tobytes()


def test_no_free_inode_burns_no_segment_id(small_fs: Path, open_tier: Opener) -> None:
    """Regression: on the old code each write that needed a new segment on a filesystem
    without a free inode raised OSError and consumed a segment id (640 in seconds)."""
    directory = small_fs / "ssd"
    tier = open_tier(directory, segment_bytes=64 << 10)  # one record per segment
    extents = [tier.write(key_of(i), b"", [payload(SIZE, i)]).result() for i in range(3)]
    assert [e.segment_id for e in extents] == [1, 2, 3]
    taken = fill_inodes(small_fs)
    for i in range(10, 210):
        with pytest.raises(TierDegradedError):
            tier.write(key_of(i), b"", [payload(SIZE, i)]).result()
    assert tier.degraded and tier.stats().disk_errors == {"ENOSPC": 1}  # tried once, not 200
    assert segment_ids(directory) == [1, 2, 3]
    taken[-1].unlink()
    assert tier.probe() is True
    extent = tier.write(key_of(99), b"", [payload(SIZE, 99)]).result()
    assert extent.segment_id == 4  # the very next id
    for i, e in enumerate(extents):
        assert read_back(tier, e) == payload(SIZE, i).tobytes()


def test_foreign_file_under_the_top_segment_name_is_ignored(tmp_path: Path) -> None:
    """Regression: on the old code a stray ``seg-99999999.kvf`` made every later write fail
    (the next id was out of range), and compaction unlinked it as a dead segment."""
    directory = tmp_path / "ssd"
    opener = Opener()
    try:
        tier = opener(directory)
        first = tier.write(key_of(1), b"", [payload(100, 1)]).result()
        tier.close()
        stray = directory / "seg-99999999.kvf"
        stray.write_bytes(b"not a kvfabric segment\n" * 1000)
        tier = opener(directory)
        assert tier.stats().ignored_files == 1
        second = tier.write(key_of(2), b"", [payload(100, 2)]).result()
        assert 1 <= second.segment_id < 99_999_999
        tier.compact(lambda k, o, n: True, min_dead_ratio=0.0)
        assert stray.read_bytes() == b"not a kvfabric segment\n" * 1000
        assert read_back(tier, first) == payload(100, 1).tobytes()
        assert read_back(tier, second) == payload(100, 2).tobytes()
    finally:
        opener.close_all()


def test_segment_ids_wrap_past_the_last_one(tmp_path: Path) -> None:
    """Regression: on the old code a segment holding the last id (here: one of ours,
    renamed) wedged the tier: every write raised KVFabricError (id out of range)."""
    directory = tmp_path / "ssd"
    opener = Opener()
    try:
        tier = opener(directory)
        first = tier.write(key_of(1), b"", [payload(100, 1)]).result()
        tier.close()
        os.rename(directory / seg_mod.segment_name(1), directory / "seg-99999999.kvf")
        tier = opener(directory)
        second = tier.write(key_of(2), b"", [payload(100, 2)]).result()
        assert second.segment_id == 1  # the lowest free id
        moved = DiskExtent(99_999_999, first.offset, first.payload_offset, first.payload_len)
        assert read_back(tier, moved) == payload(100, 1).tobytes()
        assert read_back(tier, second) == payload(100, 2).tobytes()
    finally:
        opener.close_all()


def test_compaction_tells_the_owner_a_corrupt_record_is_gone(tmp_path: Path) -> None:
    """Regression: on the old code compaction skipped a corrupt record silently and
    unlinked its segment, so the owner kept an extent that could never be read again (a
    permanent ``stale_extent``); ``forget`` did not exist."""
    opener = Opener()
    try:
        tier = opener(tmp_path / "ssd", segment_bytes=8 * ALIGN)  # four 8 KiB records each
        extents = {
            key_of(i): tier.write(key_of(i), b"", [payload(4096, i)]).result() for i in range(6)
        }
        for i in (0, 1):
            tier.delete(extents[key_of(i)])
        bad = extents[key_of(2)]
        with open(tier.path / seg_mod.segment_name(1), "r+b") as f:
            f.seek(bad.payload_offset + 10)
            f.write(b"\xff\x00\xff")
        lock = threading.Lock()
        forgotten: list[tuple[bytes, DiskExtent]] = []
        moved: dict[bytes, DiskExtent] = {}

        def relocate(key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
            with lock:
                moved[key] = new
            return True

        def forget(key: bytes, old: DiskExtent) -> None:
            with lock:
                forgotten.append((key, old))

        tier.compact(relocate, min_dead_ratio=0.5, forget=forget)
        assert forgotten == [(key_of(2), bad)]
        assert set(moved) == {key_of(3)}
        assert not (tier.path / seg_mod.segment_name(1)).exists()
        assert tier.stats().corrupt_records == 1
        assert read_back(tier, moved[key_of(3)]) == payload(4096, 3).tobytes()
    finally:
        opener.close_all()


def test_failed_records_in_a_segment_are_truncated_away(small_fs: Path, open_tier: Opener) -> None:
    """Regression: on the old code a failed write's span stayed reserved in its segment
    (used_bytes grew with every failure); now the segment file ends where the last record
    that landed ends, and the next record after recovery follows it directly. Probes that
    fail while the disk is full do not make the next one ask for more room (a first version
    doubled it per probe: after a few seconds of a full disk it never recovered)."""
    directory = small_fs / "ssd"
    tier = open_tier(directory, segment_bytes=64 * MiB)
    landed = [tier.write(key_of(i), b"", [payload(SIZE, i)]).result() for i in range(3)]
    filler = fill_blocks(small_fs)
    for i in range(10, 13):  # refused at once, or failed on the future: both typed
        with pytest.raises(TierDegradedError):
            tier.write(key_of(i), b"", [payload(SIZE, i)]).result()
    end = landed[-1].offset + landed[-1].span
    assert (directory / seg_mod.segment_name(1)).stat().st_size == end == tier.used_bytes
    for _ in range(8):  # the maintenance tick probing a full disk for a while
        assert tier.probe() is False
    os.unlink(filler)
    assert tier.probe()
    after = tier.write(key_of(20), b"", [payload(SIZE, 20)]).result()
    assert (after.segment_id, after.offset) == (1, end)
