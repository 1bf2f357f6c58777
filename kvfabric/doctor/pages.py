"""Page checks: what backs the memory tiers' arenas, reserved huge pages or transparent ones.

Contract: ``check_hugetlb`` and ``check_thp`` take the daemon's config and return one
:class:`~kvfabric.doctor.result.CheckResult` each, never raising for what they find.

* ``memory.hugetlb``: reserved huge pages against the tiers' ``huge_pages``, taken in tier
  order as the tiers take them at start-up (:mod:`kvfabric.tiers.host`: :func:`backing`);
  ``on`` without enough free is an error (the daemon refuses to start), ``auto`` without
  enough is info (shared-memory pages instead); where they suffice, a hugetlb memfd is
  faulted in once (a container's hugetlb cgroup limit shows there);
* ``memory.thp``: what pages a touched arena gets (a probe, :mod:`kvfabric.memory.pagesize`),
  with ``shmem_enabled`` and ``enabled``; 4 KiB pages under a tier not on reserved huge pages
  is a warning.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from kvfabric.config import DaemonConfig
from kvfabric.doctor.result import CheckResult, Severity
from kvfabric.memory import pagesize
from kvfabric.preflight import MEMORY_KINDS
from kvfabric.store.config import TierConfig, format_size

THP = Path("/sys/kernel/mm/transparent_hugepage")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGE = 2 << 20


def _memory_tiers(config: DaemonConfig) -> list[TierConfig]:
    return [t for t in config.store.tiers if t.kind in MEMORY_KINDS]


@dataclass(frozen=True)
class Backing:
    """How the memory tiers' arenas will be backed, in tier order as the daemon takes them:
    ``huge`` tiers on reserved huge pages, ``plain`` ones on shared-memory pages, ``short``
    ``huge_pages: on`` tiers that will not find theirs (with the bytes each wants)."""

    huge: tuple[TierConfig, ...]
    plain: tuple[TierConfig, ...]
    short: tuple[tuple[TierConfig, int], ...]
    page_bytes: int
    free_bytes: int


def backing(config: DaemonConfig) -> Backing:
    huge_page = pagesize.hugetlb_page_bytes()
    remaining = pagesize.hugetlb_free_bytes()
    huge: list[TierConfig] = []
    plain: list[TierConfig] = []
    short: list[tuple[TierConfig, int]] = []
    for tier in _memory_tiers(config):
        unit = math.lcm(tier.page_size, huge_page) if huge_page else 0
        wanted = tier.capacity - tier.capacity % unit if unit else tier.capacity
        if tier.huge_pages == "off" or (tier.huge_pages == "auto" and not unit):
            plain.append(tier)
        elif unit and tier.capacity >= unit and wanted <= remaining:
            remaining -= wanted
            huge.append(tier)
        elif tier.huge_pages == "on":  # a tier under one unit still needs a whole one
            short.append((tier, max(wanted, unit)))
        else:
            plain.append(tier)
    return Backing(
        tuple(huge), tuple(plain), tuple(short), huge_page, pagesize.hugetlb_free_bytes()
    )


def _nr_hugepages() -> int:
    try:
        return int(NR_HUGEPAGES.read_text())
    except (OSError, ValueError):
        return 0


def check_hugetlb(config: DaemonConfig) -> CheckResult:
    found = backing(config)
    free, page = found.free_bytes, found.page_bytes or HUGE
    values = (("free_bytes", free), ("page_bytes", found.page_bytes))
    asking = [t for t in _memory_tiers(config) if t.huge_pages != "off"]
    if not asking:
        return CheckResult(
            "memory.hugetlb",
            Severity.OK,
            f"no memory tier asks for reserved huge pages ({format_size(free)} free)",
            values=values,
        )
    if found.short:
        missing = sum(wanted for _, wanted in found.short)
        names = ", ".join(f"{t.name} {format_size(w)}" for t, w in found.short)
        pages = _nr_hugepages() + -(-missing // page)
        return CheckResult(
            "memory.hugetlb",
            Severity.ERROR,
            f"huge_pages: on for {names}, but only {format_size(free)} of reserved huge pages "
            "are free (after the tiers before them): the daemon will not start",
            f"sysctl -w vm.nr_hugepages={pages} (persist it in /etc/sysctl.d/), or set "
            f"store.tiers.{found.short[0][0].name}.huge_pages=auto",
            values,
        )
    if found.huge:
        names = ", ".join(f"{t.name} {format_size(t.capacity)}" for t in found.huge)
        problem = _hugetlb_memfd_problem(page)
        if problem:
            return CheckResult(
                "memory.hugetlb",
                Severity.WARN,
                f"reserved huge pages are free, but a hugetlb memfd fails: {problem}; the "
                "tiers fall back to plain pages (huge_pages: on fails)",
                "check the hugetlb cgroup limit of this container (hugetlb.2MB.max) and "
                "that the pool is the default page size",
                values,
            )
        rest = [t.name for t in found.plain if t.huge_pages == "auto"]
        return CheckResult(
            "memory.hugetlb",
            Severity.OK,
            f"reserved huge pages back {names} ({format_size(free)} free now)"
            + (f"; not enough left for {', '.join(rest)} (memory.thp)" if rest else ""),
            values=values,
        )
    autos = [t for t in found.plain if t.huge_pages == "auto"]
    names = ", ".join(t.name for t in autos)
    wanted = sum(t.capacity for t in autos)
    return CheckResult(
        "memory.hugetlb",
        Severity.INFO,
        f"{names} (huge_pages: auto): {format_size(free)} of reserved huge pages free, "
        f"{format_size(wanted)} wanted; shared-memory pages instead (memory.thp)",
        f"to back them with huge pages: sysctl -w vm.nr_hugepages="
        f"{_nr_hugepages() + -(-wanted // page)} (persist it in /etc/sysctl.d/)",
        values,
    )


def _hugetlb_memfd_problem(page: int) -> str:
    try:
        fd = os.memfd_create("kvfabric-doctor-huge", os.MFD_CLOEXEC | os.MFD_HUGETLB)
    except OSError as exc:
        return str(exc)
    try:
        os.ftruncate(fd, page)
        with mmap.mmap(fd, page, flags=mmap.MAP_SHARED) as region:
            region[0] = 1  # faults a huge page in: a cgroup limit shows here, as SIGBUS
    except OSError as exc:
        return str(exc)
    finally:
        os.close(fd)
    return ""


def _thp_setting(name: str) -> str:
    try:
        text = (THP / name).read_text()
    except OSError:
        return ""
    chosen = [word for word in text.split() if word.startswith("[")]
    return chosen[0].strip("[]") if chosen else text.strip()


def check_thp(config: DaemonConfig) -> CheckResult:
    shmem, anon = _thp_setting("shmem_enabled"), _thp_setting("enabled")
    settings = f"shmem_enabled={shmem or 'unknown'}, enabled={anon or 'unknown'}"
    plain = backing(config).plain
    try:
        page = pagesize.probe()
    except OSError as exc:  # memory.memfd says why
        page, settings = 0, f"{settings}; probe failed: {exc}"
    values: tuple[tuple[str, int | str], ...] = (
        ("arena_page_bytes", page),
        ("shmem_enabled", shmem),
        ("enabled", anon),
    )
    if not plain:
        return CheckResult(
            "memory.thp",
            Severity.OK,
            f"every memory tier is on reserved huge pages ({settings})",
            values=values,
        )
    names = ", ".join(t.name for t in plain)
    if page >= HUGE:
        return CheckResult(
            "memory.thp",
            Severity.OK,
            f"arenas of {names} get 2 MiB transparent huge pages ({settings})",
            values=values,
        )
    fix = (
        "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled (as root; lasts "
        "until reboot: set it from a boot-time unit), or reserve huge pages "
        "(sysctl vm.nr_hugepages; memory.hugetlb)"
    )
    if shmem in ("", "never", "deny"):
        return CheckResult(
            "memory.thp",
            Severity.WARN,
            f"arenas of {names} get {max(page, mmap.PAGESIZE) // 1024} KiB pages "
            f"({settings}): copies into and out of them run at about half the speed of "
            "huge-page memory",
            fix,
            values,
        )
    return CheckResult(
        "memory.thp",
        Severity.INFO,
        f"shared memory may use huge pages ({settings}), but a probe arena got "
        f"{max(page, mmap.PAGESIZE) // 1024} KiB pages (fragmented memory, or a cgroup limit)",
        "compact memory (echo 1 > /proc/sys/vm/compact_memory) or reserve huge pages",
        values,
    )
