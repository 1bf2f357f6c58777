"""Reserved and transparent huge pages against the tiers, on this machine's kernel (reserving
huge pages for one test needs root: skipped otherwise)."""

from __future__ import annotations

import mmap
from pathlib import Path

from huge_pages import reserved

from kvfabric.config import DaemonConfig, build_config
from kvfabric.doctor import pages
from kvfabric.doctor.result import Severity
from kvfabric.memory import pagesize

MiB = 1 << 20


def _config(tmp_path: Path, *tiers: dict[str, object], **store: object) -> DaemonConfig:
    return build_config(
        {"store": {"data_dir": str(tmp_path / "data"), "tiers": list(tiers), **store}}
    )


def _dram(capacity: int | str, **settings: object) -> dict[str, object]:
    return {"kind": "dram", "capacity": capacity, **settings}


def test_huge_pages_on_without_enough_reserved_is_an_error(tmp_path: Path) -> None:
    free = pagesize.hugetlb_free_bytes()
    capacity = free + 64 * MiB
    result = pages.check_hugetlb(_config(tmp_path, _dram(capacity, huge_pages="on")))
    assert result.severity is Severity.ERROR
    assert "will not start" in result.message
    assert "sysctl -w vm.nr_hugepages=" in result.fix


def test_huge_pages_auto_without_reserved_ones_falls_back_with_info(tmp_path: Path) -> None:
    free = pagesize.hugetlb_free_bytes()
    result = pages.check_hugetlb(_config(tmp_path, _dram(free + 64 * MiB)))
    assert result.severity is Severity.INFO
    assert "memory.thp" in result.message and "vm.nr_hugepages=" in result.fix


def test_reserved_huge_pages_that_cover_the_tier_are_ok(tmp_path: Path) -> None:
    with reserved(4):  # 8 MiB of 2 MiB pages (root only: skipped otherwise)
        config = _config(tmp_path, _dram("8MiB", huge_pages="on"))
        result = pages.check_hugetlb(config)
        assert result.severity is Severity.OK, result
        assert "reserved huge pages back dram" in result.message
        thp = pages.check_thp(config)
        assert thp.severity is Severity.OK
        assert "every memory tier is on reserved huge pages" in thp.message


def test_thp_agrees_with_the_kernels_setting(tmp_path: Path) -> None:
    result = pages.check_thp(_config(tmp_path, _dram("64MiB", huge_pages="off")))
    values = dict(result.values)
    if values["arena_page_bytes"] == 2 * MiB:
        assert result.severity is Severity.OK
    elif values["shmem_enabled"] in ("never", "deny", ""):
        assert result.severity is Severity.WARN
        assert values["arena_page_bytes"] == mmap.PAGESIZE
        assert "shmem_enabled" in result.fix
    else:
        assert result.severity is Severity.INFO
