"""What pages back the daemon's shared-memory arenas on this host.

An arena is a memfd (:mod:`kvfabric.memory.arena`): shared memory, which the kernel backs
with transparent huge pages only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
allows it (``always``, ``within_size``, or ``advise``, which the arena asks for). Elsewhere
(``never``, the default on many distributions) every process mapping an arena faults it
and walks it in 4 KiB pages, while a numpy buffer of the same size may get 2 MiB ones: the
figures benchmarks compare against ``memcpy`` depend on it, so they report it, and the
preflight (``kvfabric serve --check``) says what the daemon will get.

:func:`probe` maps a small arena, touches it and reads the kernel's own account of that
mapping (``/proc/self/smaps``); :func:`describe` adds the host's settings.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
PROBE_BYTES = 8 << 20  # four 2 MiB huge pages, aligned or not


@dataclass(frozen=True)
class SharedPages:
    """``page_bytes``: the pages a touched arena got (4096, or 2 MiB where the kernel gave
    huge pages); ``shmem_thp``: the kernel's setting (``never``, ``advise``, ...; "" when
    unknown); ``hugetlb_free``: huge pages reserved and free (``HugePages_Free``)."""

    page_bytes: int
    shmem_thp: str
    hugetlb_free: int

    def summary(self) -> str:
        size = (
            "2 MiB (huge pages)" if self.page_bytes >= 2 << 20 else f"{self.page_bytes // 1024} KiB"
        )
        return (
            f"{size}; shmem_enabled={self.shmem_thp or 'unknown'}, "
            f"reserved huge pages free={self.hugetlb_free}"
        )


def probe() -> int:
    """Bytes per page of a freshly touched arena in this process (4096 when unknown)."""
    from kvfabric.memory.arena import SharedArena

    arena = SharedArena.create(PROBE_BYTES, 1 << 20, name="kvfabric-page-probe")
    try:
        arena.array[:: mmap.PAGESIZE] = 1
        huge = _pmd_mapped_kib(arena.address)
    finally:
        arena.close()
    return 2 << 20 if huge else mmap.PAGESIZE


def describe() -> SharedPages:
    return SharedPages(probe(), _shmem_setting(), _hugetlb_free())


def _pmd_mapped_kib(address: int) -> int:
    """Shared memory mapped with huge pages in the mapping that starts at ``address``."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start = int(head.split("-")[0], 16)
            inside = start == address
        elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:") and int(line.split()[1]):
            return int(line.split()[1])
    return 0


def _shmem_setting() -> str:
    try:
        text = SHMEM_THP.read_text()
    except OSError:
        return ""
    chosen = [word for word in text.split() if word.startswith("[")]
    return chosen[0].strip("[]") if chosen else text.strip()


def hugetlb_page_bytes() -> int:
    """The default huge page size (``Hugepagesize``), 0 when the kernel has none."""
    return _meminfo("Hugepagesize:") * 1024


def hugetlb_free_bytes() -> int:
    """Reserved huge pages not in use, in bytes (what a hugetlb arena can take now)."""
    return _hugetlb_free() * hugetlb_page_bytes()


def _hugetlb_free() -> int:
    # reserved by a mapping but not faulted yet counts as free in HugePages_Free
    return max(0, _meminfo("HugePages_Free:") - _meminfo("HugePages_Rsvd:"))


def _meminfo(field: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0
