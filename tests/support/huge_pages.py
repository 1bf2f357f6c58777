"""Huge pages for a test: ``reserved(n)`` sets ``vm.nr_hugepages`` to ``n`` more than are
free now, ``shmem_thp(mode)`` sets the kernel's transparent huge pages for shared memory;
both put the old value back afterwards (root only: these are the machine's, like the
filesystems the disk-fault tests mount). The suite's workers run in parallel, so each block
holds one machine-wide lock: two workers reserving at once would each restore the count the
other had raised. ``hugetlb_pages(pid)`` counts one process's huge pages: the machine's totals
also move with any daemon another worker starts while pages are free (huge_pages: auto)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

NR = Path("/proc/sys/vm/nr_hugepages")
SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
LOCK = Path("/tmp/kvfabric-tests-page-settings.lock")
HUGE_PAGE_KIB = 2048


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    with LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def hugetlb_pages(pid: int) -> int:
    """The 2 MiB huge pages mapped into process ``pid`` (shared and private)."""
    kib = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Shared_Hugetlb:", "Private_Hugetlb:")):
            kib += int(line.split()[1])
    return kib // HUGE_PAGE_KIB


def _free() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def reserved(pages: int) -> Iterator[int]:
    """At least ``pages`` huge pages free inside the block (skips the test when this process
    may not reserve them, or the kernel could not find the memory)."""
    if os.geteuid() != 0 or not os.access(NR, os.W_OK):
        pytest.skip("reserving huge pages needs root (vm.nr_hugepages)")
    with _machine_lock():
        before = int(NR.read_text())
        NR.write_text(str(before + pages))
        try:
            if _free() < pages:
                pytest.skip(f"the kernel reserved only {_free()} of {pages} huge pages")
            yield pages
        finally:
            NR.write_text(str(before))


@contextlib.contextmanager
def shmem_thp(mode: str) -> Iterator[None]:
    """``shmem_enabled`` set to ``mode`` inside the block (skips without root)."""
    if os.geteuid() != 0 or not os.access(SHMEM, os.W_OK):
        pytest.skip("setting shmem_enabled needs root")
    with _machine_lock():
        words = SHMEM.read_text().split()
        before = next((w.strip("[]") for w in words if w.startswith("[")), "never")
        SHMEM.write_text(mode)
        try:
            yield
        finally:
            SHMEM.write_text(before)
