"""The SSD tier's directory and its measured speed, on this machine's disk (the small
filesystem cases are under tests/integration/doctor/)."""

from __future__ import annotations

from pathlib import Path

from kvfabric.config import DaemonConfig, build_config, load_config
from kvfabric.doctor import disk
from kvfabric.doctor.result import Severity

MiB = 1 << 20


def _config(data_dir: Path, *settings: str) -> DaemonConfig:
    return load_config(env={}, overrides=[f"store.data_dir={data_dir}", *settings])


def test_the_speed_test_measures_and_leaves_nothing_behind(tmp_path: Path) -> None:
    data = tmp_path / "not" / "yet"
    [result] = disk.check_disk_speed(_config(data), 4 * MiB, min_mb_s=0.001)
    assert (result.name, result.severity) == ("disk.speed", Severity.OK), result
    values = dict(result.values)
    assert values["bytes"] == 4 * MiB
    assert float(values["write_mb_s"]) > 0 and float(values["read_mb_s"]) > 0
    assert "MB/s" in result.message
    assert list(tmp_path.iterdir()) == []  # the file and the directories it made are gone


def test_a_disk_under_the_threshold_is_a_warning(tmp_path: Path) -> None:
    [result] = disk.check_disk_speed(_config(tmp_path / "d"), 2 * MiB, min_mb_s=1e12)
    assert result.severity is Severity.WARN
    assert "NVMe" in result.fix


def test_a_test_size_of_zero_skips_the_measurement(tmp_path: Path) -> None:
    [result] = disk.check_disk_speed(_config(tmp_path), 0)
    assert result.severity is Severity.INFO


def test_an_ssd_dir_that_cannot_be_created_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    config = _config(tmp_path / "file" / "data")
    [capacity] = disk.check_disk_capacity(config)
    assert capacity.severity is Severity.ERROR
    assert "not a directory" in capacity.message and "store.data_dir" in capacity.fix
    [speed] = disk.check_disk_speed(config, 2 * MiB)
    assert speed.severity is Severity.INFO


def test_no_ssd_tier_is_ok(tmp_path: Path) -> None:
    config = build_config(
        {"store": {"data_dir": str(tmp_path), "tiers": [{"kind": "dram", "capacity": "64MiB"}]}}
    )
    assert disk.check_disk_capacity(config)[0].severity is Severity.OK
    assert disk.check_disk_speed(config)[0].severity is Severity.OK
