"""SSD tier checks: its directory and capacity against the filesystem, and a timed write and
read there.

Contract: ``check_disk_capacity`` and ``check_disk_speed`` return one
:class:`~kvfabric.doctor.result.CheckResult` per SSD tier (one ``ok`` result without one),
never raising for what they find.

* ``disk.capacity``: the directory can be created and written, and the tier fits the free
  space of its filesystem plus what the directory holds already (the rule ``serve`` applies:
  more is an error, a warning with ``store.allow_overcommit``); a tier taking over 90% of
  that room is a warning (the filesystem fills with anything else written there);
* ``disk.speed``: a file of ``size`` bytes (64 MiB by default, at most half the free space)
  is written in 1 MiB requests and fsync'd, then read back, with ``O_DIRECT`` where the
  filesystem supports it (else buffered, its cached pages dropped before the read); each
  phase stops after :data:`PHASE_LIMIT_S`. Under ``min_mb_s`` either way is a warning. The
  file is removed, and directories created for it too.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import time
from pathlib import Path

from kvfabric.config import DaemonConfig
from kvfabric.doctor.result import CheckResult, Severity
from kvfabric.preflight import _bytes_under, _existing_ancestor, _unwritable, ssd_dir
from kvfabric.store.config import MiB, TierConfig, format_size
from kvfabric.tiers.base import TierKind

SPEED_BYTES = 64 * MiB
SPEED_MIN_MB_S = 200.0  # a SATA SSD writes ~500 MB/s; a disk this slow stalls demotions
HEADROOM = 0.9
BLOCK = 1 * MiB
PHASE_LIMIT_S = 10.0


def _ssd_tiers(config: DaemonConfig) -> list[TierConfig]:
    return [t for t in config.store.tiers if t.kind is TierKind.SSD]


def check_disk_capacity(config: DaemonConfig) -> list[CheckResult]:
    tiers = _ssd_tiers(config)
    if not tiers:
        return [CheckResult("disk.capacity", Severity.OK, "no SSD tier")]
    return [_capacity(config, tier) for tier in tiers]


def _capacity(config: DaemonConfig, tier: TierConfig) -> CheckResult:
    directory = ssd_dir(config, tier)
    problem = _unwritable(directory)
    if problem:
        return CheckResult(
            "disk.capacity",
            Severity.ERROR,
            f"ssd tier {tier.name!r} directory {directory}: {problem}",
            "give the daemon's user that directory (chown / chmod), or point "
            "store.data_dir elsewhere",
        )
    held = _bytes_under(directory)
    free = shutil.disk_usage(_existing_ancestor(directory)).free
    room = free + held
    values = (("capacity_bytes", tier.capacity), ("free_bytes", free), ("held_bytes", held))
    where = f"{directory.absolute()} has {format_size(free)} free" + (
        f" (+ {format_size(held)} the tier holds)" if held else ""
    )
    lower = f"lower store.tiers.{tier.name}.capacity below {format_size(room)}"
    if tier.capacity > room:
        allowed = config.store.allow_overcommit
        return CheckResult(
            "disk.capacity",
            Severity.WARN if allowed else Severity.ERROR,
            f"ssd tier {tier.name!r} asks for {format_size(tier.capacity)}, but {where}"
            + (" (store.allow_overcommit: serve starts anyway)" if allowed else ": serve refuses"),
            f"{lower}, or point store.data_dir at a larger filesystem",
            values,
        )
    if tier.capacity > HEADROOM * room:
        return CheckResult(
            "disk.capacity",
            Severity.WARN,
            f"ssd tier {tier.name!r} ({format_size(tier.capacity)}) takes over "
            f"{HEADROOM:.0%} of the room there ({where}): anything else written to that "
            "filesystem fills it and degrades the tier",
            f"lower store.tiers.{tier.name}.capacity below {format_size(HEADROOM * room)}",
            values,
        )
    return CheckResult(
        "disk.capacity",
        Severity.OK,
        f"ssd tier {tier.name!r} {format_size(tier.capacity)}: {where}",
        values=values,
    )


def check_disk_speed(
    config: DaemonConfig, size: int = SPEED_BYTES, min_mb_s: float = SPEED_MIN_MB_S
) -> list[CheckResult]:
    tiers = _ssd_tiers(config)
    if not tiers:
        return [CheckResult("disk.speed", Severity.OK, "no SSD tier")]
    if size <= 0:
        return [CheckResult("disk.speed", Severity.INFO, "not measured (test size 0)")]
    return [_speed(ssd_dir(config, tier), size, min_mb_s) for tier in tiers]


def _speed(directory: Path, size: int, min_mb_s: float) -> CheckResult:
    if _unwritable(directory):
        return CheckResult(
            "disk.speed", Severity.INFO, f"not measured: {directory} is not usable (disk.capacity)"
        )
    free = shutil.disk_usage(_existing_ancestor(directory)).free
    size = min(size, free // 2) // BLOCK * BLOCK
    if size < BLOCK:
        return CheckResult(
            "disk.speed",
            Severity.WARN,
            f"not measured: {directory} has {format_size(free)} free",
            "free space on that filesystem",
        )
    created = _make_dirs(directory)
    try:
        try:
            written, write_s, read_s = _measure(directory, size, direct=True)
            direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem does not do O_DIRECT
                raise
            written, write_s, read_s = _measure(directory, size, direct=False)
            direct = False
    except OSError as exc:
        return CheckResult(
            "disk.speed",
            Severity.ERROR,
            f"writing a test file in {directory} failed: {exc}",
            "check the filesystem (dmesg) and its free space",
        )
    finally:
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                pass  # someone else put something there meanwhile
    write_mb_s = written / 1e6 / max(write_s, 1e-9)
    read_mb_s = written / 1e6 / max(read_s, 1e-9)
    values = (
        ("bytes", written),
        ("write_mb_s", round(write_mb_s, 1)),
        ("read_mb_s", round(read_mb_s, 1)),
        ("o_direct", int(direct)),
    )
    how = "O_DIRECT" if direct else "buffered: this filesystem has no O_DIRECT"
    message = (
        f"{directory.absolute()}: write {write_mb_s:.0f} MB/s (fsync'd), read "
        f"{read_mb_s:.0f} MB/s ({format_size(written)}, 1 MiB requests, {how})"
    )
    if min(write_mb_s, read_mb_s) < min_mb_s:
        return CheckResult(
            "disk.speed",
            Severity.WARN,
            f"{message}: under {min_mb_s:.0f} MB/s, demotions to SSD and reads from it stall "
            "the memory tiers",
            "put store.data_dir on a local NVMe / SSD (not a network or spinning disk)",
            values,
        )
    return CheckResult("disk.speed", Severity.OK, message, values=values)


def _make_dirs(directory: Path) -> list[Path]:
    """Create ``directory`` and missing parents; the ones created, outermost first."""
    missing = []
    path = directory.absolute()
    while not path.exists():
        missing.append(path)
        path = path.parent
    missing.reverse()
    for path in missing:
        path.mkdir(mode=0o700)
    return missing


def _measure(directory: Path, size: int, *, direct: bool) -> tuple[int, float, float]:
    """(bytes, write seconds including fsync, read seconds)."""
    path = directory / f".kvfabric-doctor-{os.getpid()}.tmp"
    flag = os.O_DIRECT if direct else 0
    # an anonymous mapping is page-aligned, as O_DIRECT needs; random bytes defeat
    # compressing and deduplicating filesystems
    with mmap.mmap(-1, BLOCK) as buf:
        buf.write(os.urandom(BLOCK))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag, 0o600)
            try:
                written, started = 0, time.perf_counter()
                while written < size and time.perf_counter() - started < PHASE_LIMIT_S:
                    written += os.write(fd, buf)
                os.fsync(fd)
                write_s = time.perf_counter() - started
            finally:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
            try:
                if not direct:  # else the read measures the page cache
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done, started = 0, time.perf_counter()
                while done < written and time.perf_counter() - started < PHASE_LIMIT_S:
                    got = os.readv(fd, [buf])
                    if not got:
                        break
                    done += got
                read_s = time.perf_counter() - started
            finally:
                os.close(fd)
        finally:
            path.unlink(missing_ok=True)
    return written, write_s, read_s * written / max(done, 1)
