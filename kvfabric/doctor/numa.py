"""NUMA checks: a tier's ``numa_node`` against the machine's nodes.

Contract: :func:`check_numa` returns ``memory.numa`` (ok) when no memory tier is bound to a
node and no tier is cxl, else one ``memory.numa.<tier>`` result per such tier, never raising:
a node the machine lacks, or a cxl tier without ``numa_node``, is a warning (the daemon
leaves the tier unbound: plain DRAM, its documented degraded mode); a tier larger than its
node is an error (bound pages cannot spill); a cxl tier on a node with CPUs is info (a
socket's local memory, not a CXL expander).
"""

from __future__ import annotations

from pathlib import Path

from kvfabric.config import DaemonConfig
from kvfabric.doctor.result import CheckResult, Severity
from kvfabric.memory.numa import available_nodes
from kvfabric.preflight import MEMORY_KINDS
from kvfabric.store.config import TierConfig, format_size
from kvfabric.tiers.base import TierKind

NODE_ROOT = Path("/sys/devices/system/node")


def _node_total(node: int) -> int:
    try:
        for line in (NODE_ROOT / f"node{node}" / "meminfo").read_text().splitlines():
            if "MemTotal:" in line:
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _node_cpus(node: int) -> str:
    try:
        return (NODE_ROOT / f"node{node}" / "cpulist").read_text().strip()
    except OSError:
        return ""


def check_numa(config: DaemonConfig) -> list[CheckResult]:
    nodes = available_nodes()
    cpuless = [n for n in nodes if not _node_cpus(n)]
    listing = f"nodes {nodes}" + (f", CPU-less {cpuless}" if cpuless else "")
    tiers = [
        t
        for t in config.store.tiers
        if t.kind in MEMORY_KINDS and (t.numa_node is not None or t.kind is TierKind.CXL)
    ]
    if not tiers:
        return [
            CheckResult("memory.numa", Severity.OK, f"no tier is bound to a NUMA node ({listing})")
        ]
    return [_numa_tier(tier, nodes, cpuless, listing) for tier in tiers]


def _numa_tier(tier: TierConfig, nodes: list[int], cpuless: list[int], listing: str) -> CheckResult:
    name = f"memory.numa.{tier.name}"
    key = f"store.tiers.{tier.name}.numa_node"
    choose = f"set {key} to " + (
        f"the CXL memory's node ({cpuless[0]}; `numactl -H` lists them)"
        if cpuless
        else "a node `numactl -H` lists (a CXL expander shows as a CPU-less node)"
    )
    if tier.numa_node is None:
        return CheckResult(
            name,
            Severity.WARN,
            f"cxl tier {tier.name!r} has no numa_node: its memory lands wherever the kernel "
            f"puts it, i.e. plain DRAM ({listing})",
            choose,
        )
    if tier.numa_node not in nodes:
        return CheckResult(
            name,
            Severity.WARN,
            f"{key} is {tier.numa_node}, which this machine does not have ({listing}): the "
            "daemon leaves the tier unbound (plain DRAM)",
            choose,
        )
    total = _node_total(tier.numa_node)
    values = (("node", tier.numa_node), ("node_bytes", total))
    if total and tier.capacity > total:
        return CheckResult(
            name,
            Severity.ERROR,
            f"tier {tier.name!r} ({format_size(tier.capacity)}) is bound to node "
            f"{tier.numa_node}, which has {format_size(total)}: bound pages cannot spill, the "
            "daemon is killed when the node is full",
            f"lower store.tiers.{tier.name}.capacity below {format_size(total)}",
            values,
        )
    if tier.kind is TierKind.CXL and tier.numa_node not in cpuless:
        return CheckResult(
            name,
            Severity.INFO,
            f"cxl tier {tier.name!r} is on node {tier.numa_node}, which has CPUs "
            f"({_node_cpus(tier.numa_node)}): a socket's local memory, not a CXL expander",
            choose if cpuless else "",
            values,
        )
    return CheckResult(
        name,
        Severity.OK,
        f"tier {tier.name!r} on node {tier.numa_node} ({format_size(total)})",
        values=values,
    )
