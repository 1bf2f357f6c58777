"""Shared-memory arena: one memfd region cut into fixed-size pages.

The creating process (the store, later the node daemon) owns the region and its
:class:`~kvfabric.memory.pages.PageAllocator`; other processes :meth:`SharedArena.attach`
to the same file descriptor (inherited, or passed over a Unix socket with SCM_RIGHTS) and
read or write pages in place: no byte is copied through a socket on the local path.

Mapping rules: the region is ``MAP_SHARED``; ``size`` is a multiple of ``page_size``, and
``page_size`` a multiple of the OS page size, so every page starts on an OS page boundary.
An arena may be bound to a NUMA node (see :mod:`kvfabric.memory.numa`) before it is touched.

What a process that receives the descriptor can do to the region (the daemon hands it to
clients it trusts only with their own tenant's objects):

* it cannot change its size: the memfd is sealed with ``F_SEAL_SHRINK | F_SEAL_GROW`` and
  ``F_SEAL_SEAL`` before anyone else sees it (a shrunk memfd would SIGBUS every mapper,
  the daemon included, on its next touch of the cut pages);
* given a descriptor from :meth:`SharedArena.read_only_fd` it can only read: the descriptor
  is ``O_RDONLY`` (no writable shared mapping, no ``write``), and the memfd's mode is 0400,
  so reopening it through ``/proc/<pid>/fd`` for writing is refused too (root excepted);
* :meth:`SharedArena.attach` with ``writable=False`` maps ``PROT_READ``: a stray write
  through a reader's view faults in that process instead of changing the bytes.

Freed memory goes back to the OS with :meth:`SharedArena.release` (``MADV_REMOVE``: the
pages read as zeros afterwards, in every process that maps them).

Huge pages: an arena created with ``hugetlb=True`` is a ``MFD_HUGETLB`` memfd, backed by
the huge pages the node reserved (``vm.nr_hugepages``), so every process that maps it walks
2 MiB pages; its size must be a multiple of the huge page size, it stays resident
(``release`` is a no-op: the reservation holds the memory anyway). Otherwise the mapping
asks for transparent huge pages, which the kernel grants shared memory only where
``shmem_enabled`` allows (:mod:`kvfabric.memory.pagesize`).

Thread-safety: views are plain memory; the arena object itself is immutable after creation
except :meth:`close`, which the owner calls once no view is in use.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os

import numpy as np

from kvfabric.memory import numa

log = logging.getLogger(__name__)

OS_PAGE = mmap.PAGESIZE
MIN_PAGE_SIZE = 4096
MAX_PAGE_SIZE = 1 << 30
# size can never change once the region is shared, and no further seal can be added (a
# client adding F_SEAL_FUTURE_WRITE would stop every other client from mapping it writable)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def check_geometry(size: int, page_size: int) -> None:
    """Raise ``ValueError`` unless ``size`` / ``page_size`` describe a valid arena."""
    if page_size < MIN_PAGE_SIZE or page_size > MAX_PAGE_SIZE or page_size % OS_PAGE:
        raise ValueError(
            f"page_size must be a multiple of {OS_PAGE} in "
            f"[{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}], got {page_size}"
        )
    if size <= 0 or size % page_size:
        raise ValueError(
            f"arena size must be a positive multiple of page_size={page_size}, got {size}"
        )


def _ask_for_huge_pages(region: mmap.mmap) -> None:
    """Transparent huge pages for the mapping where the kernel allows them for shared memory
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` = ``advise``): copies and peer
    transfers of a 4 KiB-paged memfd run at about half the speed here. A no-op elsewhere."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:
            pass  # the kernel does not do it for this mapping: plain pages


class SharedArena:
    """A ``MAP_SHARED`` memfd region viewed as ``num_pages`` pages of ``page_size`` bytes."""

    def __init__(
        self,
        fd: int,
        size: int,
        page_size: int,
        *,
        owner: bool,
        writable: bool = True,
        hugetlb: bool = False,
    ) -> None:
        check_geometry(size, page_size)
        self._fd = fd
        self._size = size
        self._page_size = page_size
        self._owner = owner
        self.writable = writable
        self.hugetlb = hugetlb
        prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        _ask_for_huge_pages(self._map)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.numa_node: int | None = None

    @classmethod
    def create(
        cls,
        size: int,
        page_size: int,
        *,
        name: str = "kvfabric",
        numa_node: int | None = None,
        prefault: bool = False,
        hugetlb: bool = False,
    ) -> SharedArena:
        """A new anonymous shared region (memfd), optionally NUMA-bound, pre-faulted, and
        backed by reserved huge pages (``hugetlb``: OSError when the node has too few)."""
        check_geometry(size, page_size)
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugetlb else 0)
        fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            os.fchmod(fd, 0o400)  # a read-only holder cannot reopen it writable (see above)
            arena = cls(fd, size, page_size, owner=True, hugetlb=hugetlb)
        except BaseException:
            os.close(fd)
            raise
        if numa_node is not None and numa.bind(arena.address, size, numa_node):
            arena.numa_node = numa_node
        if prefault:
            arena._array[::OS_PAGE] = 0  # touch every OS page now, not on the first put
        return arena

    @classmethod
    def attach(cls, fd: int, size: int, page_size: int, *, writable: bool = True) -> SharedArena:
        """Map an arena another process created (``writable=False``: ``PROT_READ``, which an
        ``O_RDONLY`` descriptor needs); ``fd`` is then owned by the new object."""
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"arena fd holds {actual} bytes, expected {size}")
        return cls(fd, size, page_size, owner=False, writable=writable)

    def read_only_fd(self) -> int:
        """A new ``O_RDONLY`` descriptor of the region (the caller closes it): what a
        process that may only read gets. Reopened through ``/proc/self/fd``, which gives a
        file description of its own, not a duplicate of the writable one."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def release(self, start: int, length: int) -> None:
        """Give the memory of bytes ``[start, start+length)`` back to the OS (they read as
        zeros afterwards). Page-aligned; only on the owner's writable mapping."""
        if start % OS_PAGE or length % OS_PAGE or start < 0 or start + length > self._size:
            raise ValueError(
                f"release of [{start}, {start + length}) is not page-aligned inside the arena"
            )
        if length and not self.hugetlb:  # reserved huge pages stay reserved: nothing to give
            self._map.madvise(mmap.MADV_REMOVE, start, length)

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def size(self) -> int:
        return self._size

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._size // self._page_size

    @property
    def address(self) -> int:
        """Virtual address of the mapping (for NUMA binding and transport registration)."""
        return int(self._array.ctypes.data)

    @property
    def array(self) -> np.ndarray:
        """The whole region as a flat uint8 array (a view, no copy)."""
        return self._array

    def page(self, page_id: int) -> np.ndarray:
        """One page as a uint8 view."""
        if not 0 <= page_id < self.num_pages:
            raise IndexError(f"page {page_id} outside [0, {self.num_pages})")
        start = page_id * self._page_size
        return self._array[start : start + self._page_size]

    def close(self) -> None:
        """Unmap and close the fd. Views still held elsewhere keep the mapping alive."""
        if self._fd < 0:
            return
        self._array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            # A caller still holds a view; the mapping goes away with the last view.
            log.debug("arena closed while views are alive; unmapping deferred")
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> SharedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
