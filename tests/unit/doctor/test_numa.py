"""A tier's numa_node against this machine's NUMA nodes (from sysfs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.config import DaemonConfig, build_config
from kvfabric.doctor import numa
from kvfabric.doctor.result import Severity
from kvfabric.memory.numa import available_nodes

GiB = 1 << 30


def _config(tmp_path: Path, *tiers: dict[str, object], **store: object) -> DaemonConfig:
    return build_config(
        {"store": {"data_dir": str(tmp_path / "data"), "tiers": list(tiers), **store}}
    )


def _dram(capacity: int | str, **settings: object) -> dict[str, object]:
    return {"kind": "dram", "capacity": capacity, **settings}


def test_a_numa_node_the_machine_lacks_is_a_warning(tmp_path: Path) -> None:
    missing = max(available_nodes()) + 7
    [result] = numa.check_numa(_config(tmp_path, _dram("64MiB", numa_node=missing)))
    assert (result.name, result.severity) == ("memory.numa.dram", Severity.WARN)
    assert "does not have" in result.message and "numa_node" in result.fix


def test_a_cxl_tier_without_a_node_is_plain_dram(tmp_path: Path) -> None:
    config = _config(tmp_path, _dram("64MiB"), {"kind": "cxl", "capacity": "64MiB"})
    [result] = numa.check_numa(config)
    assert (result.name, result.severity) == ("memory.numa.cxl", Severity.WARN)
    assert "plain DRAM" in result.message


def test_a_tier_larger_than_its_node_is_an_error(tmp_path: Path) -> None:
    node = available_nodes()[0]
    size = numa._node_total(node)
    if not size:
        pytest.skip("sysfs gives no MemTotal for the node")
    config = _config(
        tmp_path, _dram("64MiB"), {"kind": "cxl", "capacity": size + GiB, "numa_node": node}
    )
    [result] = numa.check_numa(config)
    assert result.severity is Severity.ERROR
    assert f"node {node}" in result.message and "store.tiers.cxl.capacity" in result.fix


def test_no_tier_on_a_node_is_ok(tmp_path: Path) -> None:
    [result] = numa.check_numa(_config(tmp_path, _dram("64MiB")))
    assert (result.name, result.severity) == ("memory.numa", Severity.OK)
