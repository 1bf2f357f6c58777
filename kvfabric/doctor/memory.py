"""Memory checks: /dev/shm, memfd arenas, and the memory tiers against RAM (pages:
:mod:`kvfabric.doctor.pages`; NUMA nodes: :mod:`kvfabric.doctor.numa`).

Contract: each ``check_*`` returns one :class:`~kvfabric.doctor.result.CheckResult`, never
raising for what it finds.

* ``memory.shm``: /dev/shm's size. The arenas are memfds (not in /dev/shm), but engines on
  the node (torch multiprocessing, NCCL, vLLM's message queues) use it, and a container's
  default (64 MiB) breaks them: under :data:`SHM_MIN_BYTES` is a warning;
* ``memory.memfd``: a memfd is created, sealed against shrink / grow as the arenas are,
  mapped and written; a seal that does not hold is an error (clients could SIGBUS the daemon);
* ``memory.capacity``: the memory tiers against physical RAM (or the cgroup limit) and the
  prefaulted ones against what is available now: the rule ``serve`` applies (it refuses
  both unless ``store.allow_overcommit``), so they are errors here, warnings with it; tiers
  that fit RAM but not what is available now are a warning.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

from kvfabric.config import DaemonConfig
from kvfabric.doctor.result import CheckResult, Severity
from kvfabric.memory.arena import SEALS
from kvfabric.preflight import MEMORY_KINDS, memory_info
from kvfabric.store.config import GiB, MiB, TierConfig, format_size

SHM = Path("/dev/shm")
SHM_MIN_BYTES = 1 * GiB  # below this, engines' shared-memory queues and NCCL run short


def _memory_tiers(config: DaemonConfig) -> list[TierConfig]:
    return [t for t in config.store.tiers if t.kind in MEMORY_KINDS]


# -- /dev/shm and memfd -----------------------------------------------------------------


def check_shm(path: Path = SHM) -> CheckResult:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return CheckResult(
            "memory.shm",
            Severity.WARN,
            f"{path}: {exc.strerror}; engines on this node (torch, NCCL) need it",
            "mount a tmpfs there (containers: --shm-size=8g, or an emptyDir with "
            "medium: Memory on /dev/shm)",
        )
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    values = (("size_bytes", size), ("free_bytes", free))
    if size < SHM_MIN_BYTES:
        return CheckResult(
            "memory.shm",
            Severity.WARN,
            f"{path} is {format_size(size)} ({format_size(free)} free): engines on this node "
            "(torch multiprocessing, NCCL, vLLM) run out of it; the arenas themselves are "
            "memfds, not in /dev/shm",
            f"give {path} at least {format_size(SHM_MIN_BYTES)} (docker: --shm-size=8g; "
            "Kubernetes: an emptyDir with medium: Memory mounted there)",
            values,
        )
    return CheckResult(
        "memory.shm",
        Severity.OK,
        f"{path} {format_size(size)}, {format_size(free)} free",
        values=values,
    )


def check_memfd() -> CheckResult:
    """A memfd sealed as the arenas are (shrink, grow, seal), then mapped and written."""
    blocked_fix = (
        "memfd_create is refused here: allow it in the container's seccomp profile "
        "(docker's default allows it) or run on Linux 3.17 or later"
    )
    try:
        fd = os.memfd_create("kvfabric-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as exc:
        return CheckResult(
            "memory.memfd", Severity.ERROR, f"memfd_create failed: {exc}", blocked_fix
        )
    try:
        os.ftruncate(fd, 2 * MiB)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        try:
            os.ftruncate(fd, 4 * MiB)
            grew = True
        except PermissionError:
            grew = False  # what the seal promises
        with mmap.mmap(fd, 2 * MiB, flags=mmap.MAP_SHARED) as region:
            region[: 1 << 12] = b"\x5a" * (1 << 12)
            written = region[:4] == b"\x5a" * 4
    except OSError as exc:
        return CheckResult(
            "memory.memfd",
            Severity.ERROR,
            f"a sealed memfd could not be set up: {exc}",
            "the daemon seals every arena (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): run on a "
            "kernel and filesystem that support memfd sealing (Linux 3.17+)",
        )
    finally:
        os.close(fd)
    if seals & SEALS != SEALS or grew or not written:
        return CheckResult(
            "memory.memfd",
            Severity.ERROR,
            f"memfd seals do not hold (seals {seals:#x}, grew after sealing: {grew}): a client "
            "could resize an arena under the daemon",
            "run on a kernel with working memfd sealing (Linux 3.17+, no LD_PRELOAD shim "
            "intercepting memfd_create)",
        )
    return CheckResult("memory.memfd", Severity.OK, "memfd_create, sealing and mapping work")


# -- capacity ---------------------------------------------------------------------------


def check_capacity(config: DaemonConfig) -> CheckResult:
    tiers = _memory_tiers(config)
    if not tiers:
        return CheckResult("memory.capacity", Severity.OK, "no memory tier")
    info = memory_info()
    total = sum(t.capacity for t in tiers)
    prefaulted = sum(t.capacity for t in tiers if t.prefault)
    names = " + ".join(f"{t.name} {format_size(t.capacity)}" for t in tiers)
    values = (
        ("tiers_bytes", total),
        ("prefaulted_bytes", prefaulted),
        ("memory_bytes", info.total),
        ("available_bytes", info.available),
    )
    refused = Severity.WARN if config.store.allow_overcommit else Severity.ERROR
    tail = (
        " (store.allow_overcommit is set: serve starts anyway)"
        if config.store.allow_overcommit
        else ": serve refuses to start"
    )
    lower = f"lower the memory tiers' capacities (store.tiers.{tiers[0].name}.capacity, ...) "
    if total > info.total:
        return CheckResult(
            "memory.capacity",
            refused,
            f"the memory tiers ({names}) need {format_size(total)}, more than the "
            f"{format_size(info.total)} of {info.source}{tail}",
            lower + f"well below {format_size(info.total)}: the engines need memory too",
            values,
        )
    if prefaulted > info.available:
        return CheckResult(
            "memory.capacity",
            refused,
            f"the prefaulted tiers need {format_size(prefaulted)} at start-up, "
            f"{format_size(info.available)} is available now{tail}",
            lower + "or set prefault: false (pages are then taken as they fill)",
            values,
        )
    if total > info.available:
        return CheckResult(
            "memory.capacity",
            Severity.WARN,
            f"the memory tiers ({names}) fit {info.source} ({format_size(info.total)}), but "
            f"not what is available now ({format_size(info.available)}): as they fill, the "
            "host reclaims, swaps or kills",
            lower + f"below {format_size(info.available)}, or free memory on the node",
            values,
        )
    return CheckResult(
        "memory.capacity",
        Severity.OK,
        f"memory tiers {names}: {format_size(total)} of {format_size(info.total)} "
        f"{info.source} ({format_size(info.available)} available)",
        values=values,
    )
