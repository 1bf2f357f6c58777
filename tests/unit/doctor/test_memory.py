"""/dev/shm, memfd sealing and the memory tiers against this machine's real RAM."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.config import DaemonConfig, build_config
from kvfabric.doctor import memory
from kvfabric.doctor.result import Severity
from kvfabric.preflight import memory_info

MiB, GiB = 1 << 20, 1 << 30


def _config(tmp_path: Path, *tiers: dict[str, object], **store: object) -> DaemonConfig:
    return build_config(
        {"store": {"data_dir": str(tmp_path / "data"), "tiers": list(tiers), **store}}
    )


def _dram(capacity: int | str, **settings: object) -> dict[str, object]:
    return {"kind": "dram", "capacity": capacity, **settings}


def test_memory_tiers_larger_than_physical_ram_are_an_error(tmp_path: Path) -> None:
    total = memory_info().total
    result = memory.check_capacity(_config(tmp_path, _dram(total + GiB)))
    assert result.severity is Severity.ERROR
    assert "more than the" in result.message and "serve refuses to start" in result.message
    assert "store.tiers.dram.capacity" in result.fix
    assert dict(result.values)["memory_bytes"] == total


def test_overcommit_turns_the_refusal_into_a_warning(tmp_path: Path) -> None:
    config = _config(tmp_path, _dram(memory_info().total + GiB), allow_overcommit=True)
    result = memory.check_capacity(config)
    assert result.severity is Severity.WARN
    assert "store.allow_overcommit" in result.message


def test_memory_tiers_that_fit_are_ok(tmp_path: Path) -> None:
    result = memory.check_capacity(_config(tmp_path, _dram("64MiB")))
    assert result.severity is Severity.OK
    assert "dram 64.0 MiB" in result.message


def test_prefaulting_more_than_is_available_is_an_error(tmp_path: Path) -> None:
    """Between MemAvailable and MemTotal: prefaulted, serve refuses; not prefaulted, it
    starts but the tier cannot fill (a warning)."""
    info = memory_info()
    if info.total - info.available < 1 * GiB:
        pytest.skip("less than 1 GiB between MemAvailable and MemTotal here")
    between = (info.total + info.available) // 2 // MiB * MiB
    prefaulted = memory.check_capacity(_config(tmp_path, _dram(between, prefault=True)))
    assert prefaulted.severity is Severity.ERROR
    assert "prefault" in prefaulted.message and "prefault: false" in prefaulted.fix
    lazy = memory.check_capacity(_config(tmp_path, _dram(between)))
    assert lazy.severity is Severity.WARN
    assert "available now" in lazy.message


def test_memfd_sealing_holds_here() -> None:
    result = memory.check_memfd()
    assert (result.name, result.severity) == ("memory.memfd", Severity.OK)


def test_dev_shm_is_reported_with_its_size() -> None:
    result = memory.check_shm()
    size = dict(result.values).get("size_bytes", 0)
    expected = Severity.OK if size >= memory.SHM_MIN_BYTES else Severity.WARN
    assert result.severity is expected
    assert "/dev/shm" in result.message


def test_a_missing_shm_mount_is_a_warning_with_the_fix(tmp_path: Path) -> None:
    result = memory.check_shm(tmp_path / "no-shm")
    assert result.severity is Severity.WARN
    assert "--shm-size" in result.fix
