"""The SSD tier on a real, small filesystem (a 16 MiB tmpfs mounted by the test: root only,
skipped otherwise): a capacity larger than the filesystem is an error, one that fits is ok,
and the speed test stays inside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from small_fs import tmpfs

from kvfabric.config import DaemonConfig, load_config
from kvfabric.doctor import disk, memory
from kvfabric.doctor.result import Severity

MiB = 1 << 20


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", size="16m", inodes=64) as mounted:
        yield mounted


def _config(data_dir: Path, capacity: str, *settings: str) -> DaemonConfig:
    return load_config(
        env={},
        overrides=[
            f"store.data_dir={data_dir}",
            f"store.tiers.ssd.capacity={capacity}",
            *settings,
        ],
    )


def test_an_ssd_tier_larger_than_the_filesystem_is_an_error(small: Path) -> None:
    [result] = disk.check_disk_capacity(_config(small / "data", "1GiB"))
    assert result.severity is Severity.ERROR
    assert "asks for 1.0 GiB" in result.message and "serve refuses" in result.message
    assert "store.tiers.ssd.capacity" in result.fix and "larger filesystem" in result.fix


def test_overcommit_makes_it_a_warning(small: Path) -> None:
    config = _config(small / "data", "1GiB", "store.allow_overcommit=true")
    [result] = disk.check_disk_capacity(config)
    assert result.severity is Severity.WARN


def test_an_ssd_tier_that_fits_is_ok(small: Path) -> None:
    [result] = disk.check_disk_capacity(_config(small / "data", "4MiB"))
    assert result.severity is Severity.OK, result
    assert dict(result.values)["free_bytes"] <= 16 * MiB


def test_a_tier_that_leaves_no_headroom_is_a_warning(small: Path) -> None:
    [result] = disk.check_disk_capacity(_config(small / "data", "15MiB"))
    assert result.severity is Severity.WARN and "90%" in result.message


def test_what_the_tier_holds_counts_as_room(small: Path) -> None:
    """A restarted daemon's segments are its own: 12 MiB written, 12 MiB asked -> fits."""
    segments = small / "data" / "ssd"
    segments.mkdir(parents=True)
    (segments / "segment-0").write_bytes(b"\0" * (12 * MiB))
    [result] = disk.check_disk_capacity(_config(small / "data", "12MiB"))
    assert result.severity is not Severity.ERROR, result
    assert "the tier holds" in result.message


def test_the_speed_test_fits_in_half_the_free_space(small: Path) -> None:
    [result] = disk.check_disk_speed(_config(small / "data", "4MiB"), 64 * MiB, min_mb_s=0.001)
    assert result.severity is Severity.OK, result
    values = dict(result.values)
    assert values["bytes"] <= 8 * MiB  # half of 16 MiB at most
    assert values["o_direct"] in (0, 1)
    assert list(small.iterdir()) == []


def test_a_small_shm_mount_is_a_warning(small: Path) -> None:
    result = memory.check_shm(small)
    assert result.severity is Severity.WARN
    assert "16.0 MiB" in result.message and "--shm-size" in result.fix
