"""What pages back the arenas: the probe reads the kernel's own account of a touched arena,
and an arena on reserved huge pages is one (every process that maps it walks 2 MiB pages)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
from huge_pages import reserved, shmem_thp

from kvfabric.errors import CapacityError
from kvfabric.memory import pagesize
from kvfabric.memory.arena import SharedArena
from kvfabric.tiers.base import TierKind
from kvfabric.tiers.host import HostTier

MiB = 1 << 20


def hugetlb_in_use() -> int:
    meminfo = Path("/proc/meminfo").read_text()
    values = {line.split(":")[0]: int(line.split()[1]) for line in meminfo.splitlines()}
    return values["HugePages_Total"] - values["HugePages_Free"]


def test_the_probe_agrees_with_the_kernels_setting() -> None:
    pages = pagesize.describe()
    assert pages.page_bytes in (mmap.PAGESIZE, 2 * MiB)
    if pages.shmem_thp in ("never", "deny"):  # shared memory never gets THP then
        assert pages.page_bytes == mmap.PAGESIZE
    summary = pages.summary()
    assert pages.shmem_thp in summary
    assert ("KiB" in summary) != ("2 MiB" in summary)


def test_the_probe_sees_huge_pages_where_the_kernel_gives_them() -> None:
    """The negative control of the probe: with shmem_enabled=advise (the arena asks) a
    touched arena is mapped with 2 MiB pages, and the probe says so."""
    with shmem_thp("advise"):
        assert pagesize.probe() == 2 * MiB
    with shmem_thp("never"):
        assert pagesize.probe() == mmap.PAGESIZE


def test_a_tier_takes_reserved_huge_pages_when_enough_are_free() -> None:
    with reserved(40):
        tier = HostTier("dram", TierKind.DRAM, 64 * MiB + 100, 256 * 1024, huge_pages="auto")
        try:
            assert tier.arena.hugetlb and tier.arena.size == 64 * MiB  # whole huge pages
            before = hugetlb_in_use()
            tier.arena.array[:: mmap.PAGESIZE] = 1
            assert hugetlb_in_use() - before == 32  # 64 MiB in 2 MiB pages, as touched
            tier.arena.release(0, 4 * MiB)  # reserved pages stay: a no-op, not an error
            assert tier.arena.array[0] == 1
            # another process maps the same descriptor: the same huge pages
            other = SharedArena.attach(
                tier.arena.read_only_fd(), 64 * MiB, 256 * 1024, writable=False
            )
            assert other.array[mmap.PAGESIZE] == 1
            other.close()
        finally:
            tier.close()


def test_without_enough_free_auto_takes_plain_pages_and_on_refuses_to_start() -> None:
    with reserved(8):  # 16 MiB: short of a 64 MiB tier
        plain = HostTier("dram", TierKind.DRAM, 64 * MiB, 256 * 1024, huge_pages="auto")
        assert not plain.arena.hugetlb
        plain.close()
        with pytest.raises(CapacityError, match="vm.nr_hugepages"):
            HostTier("dram", TierKind.DRAM, 64 * MiB, 256 * 1024, huge_pages="on")
        off = HostTier("dram", TierKind.DRAM, 8 * MiB, 256 * 1024, huge_pages="off")
        assert not off.arena.hugetlb  # it would have fit: off means off
        off.close()


def test_a_tenants_arena_keeps_its_exact_size() -> None:
    with reserved(16):
        tier = HostTier("dram", TierKind.DRAM, 16 * MiB, 256 * 1024, huge_pages="auto")
        try:
            tier.add_pool("acme", 3 * MiB + 256 * 1024)  # not whole huge pages: plain pages
            assert tier.arenas["acme"].size == 3 * MiB + 256 * 1024
            assert not tier.arenas["acme"].hugetlb
        finally:
            tier.close()
