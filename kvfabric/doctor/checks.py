"""Every doctor check, in the order a daemon meets what it checks.

Contract: :func:`run_checks` runs them all on one config and returns their results, in a
fixed order (memory, cpu, limits, disk, index, transport, places). A check that raises instead of
returning a result (a bug, or a host stranger than it expects) becomes an ``error`` result
under its own name, saying so; the traceback is logged at DEBUG (``kvfabric -v doctor``).
:class:`Options` bounds the active probes (the SSD test file, the Redis round trips).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvfabric.config import DaemonConfig
from kvfabric.doctor import cpuidle, disk, index, limits, memory, numa, pages, places, transport
from kvfabric.doctor.result import CheckResult, Severity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Options:
    """``ssd_test_bytes``: the timed file in the SSD tier's directory (0: not measured);
    ``ssd_min_mb_s``: slower is a warning; ``redis_pings``: PING round trips timed."""

    ssd_test_bytes: int = disk.SPEED_BYTES
    ssd_min_mb_s: float = disk.SPEED_MIN_MB_S
    redis_pings: int = index.PINGS


Check = Callable[[], CheckResult | list[CheckResult]]


def run_checks(config: DaemonConfig, options: Options | None = None) -> list[CheckResult]:
    opts = options or Options()
    found = transport.probe_nixl()
    checks: list[tuple[str, Check]] = [
        ("memory.shm", memory.check_shm),
        ("memory.memfd", memory.check_memfd),
        ("memory.hugetlb", lambda: pages.check_hugetlb(config)),
        ("memory.thp", lambda: pages.check_thp(config)),
        ("memory.numa", lambda: numa.check_numa(config)),
        ("memory.capacity", lambda: memory.check_capacity(config)),
        ("cpu.idle", cpuidle.check_idle),
        ("limits.nofile", lambda: limits.check_nofile(config)),
        ("limits.memlock", lambda: limits.check_memlock(config, nixl_usable=found.usable)),
        ("disk.capacity", lambda: disk.check_disk_capacity(config)),
        (
            "disk.speed",
            lambda: disk.check_disk_speed(config, opts.ssd_test_bytes, opts.ssd_min_mb_s),
        ),
        ("index.redis", lambda: index.check_index(config, opts.redis_pings)),
        ("transport.nixl", lambda: transport.check_transport(config, found)),
        ("places.socket_dir", lambda: places.check_socket_dir(config)),
        ("places.socket", lambda: places.check_socket(config)),
        ("places.http_port", lambda: places.check_port(config, "http")),
        ("places.tcp_port", lambda: places.check_port(config, "tcp")),
    ]
    results: list[CheckResult] = []
    for name, check in checks:
        try:
            out = check()
        except Exception as exc:  # one broken check must not hide the others' findings
            log.debug("check %s failed", name, exc_info=True)
            out = CheckResult(
                name,
                Severity.ERROR,
                f"the check itself failed: {type(exc).__name__}: {exc}",
                "run `kvfabric -v doctor` for the traceback and report it",
            )
        results += out if isinstance(out, list) else [out]
    return results
