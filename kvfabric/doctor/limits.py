"""Process limits the daemon runs into: open files (RLIMIT_NOFILE) and locked memory
(RLIMIT_MEMLOCK).

Contract: ``check_nofile`` / ``check_memlock`` judge the limits of this process (the shell
``kvfabric serve`` would be started from), or the ``(soft, hard)`` pair given, and return one
:class:`~kvfabric.doctor.result.CheckResult` each.

* ``limits.nofile``: every session, pending connection, peer connection, HTTP connection and
  SSD segment holds a descriptor. The shipped units need a soft limit of at least
  :data:`NOFILE_NEEDED` (``daemons/kvfabric.service`` sets it; the Kubernetes entry command
  refuses to start below it). Below it: a warning when the soft limit can be raised to it
  (``ulimit -n``), an error when the hard limit is lower too, or when the soft limit is below
  what the configured caps alone can hold open (:func:`descriptor_floor`: EMFILE before a cap);
* ``limits.memlock``: with the redis index the peer transport registers every memory tier
  (plus ``cluster.wire_staging_bytes``); over NIXL, UCX's RDMA transports pin what is
  registered, within RLIMIT_MEMLOCK. A lower limit is a warning (registering can fail on an
  RDMA NIC; without one UCX pins nothing); with the socket transport nothing is pinned (info).
"""

from __future__ import annotations

import resource

from kvfabric.config import DaemonConfig
from kvfabric.doctor.result import CheckResult, Severity
from kvfabric.preflight import MEMORY_KINDS
from kvfabric.store.config import format_size
from kvfabric.tiers.base import TierKind

NOFILE_NEEDED = 65536
# the daemon's own descriptors besides the capped ones: listeners, arenas, logs, redis, epoll
BASE_DESCRIPTORS = 256
UNLIMITED = resource.RLIM_INFINITY


def descriptor_floor(config: DaemonConfig) -> int:
    """Descriptors the configured caps let the daemon hold at once."""
    limits = config.limits
    segments = sum(
        -(-t.capacity // t.segment_bytes) for t in config.store.tiers if t.kind is TierKind.SSD
    )
    return (
        limits.max_sessions
        + limits.control_max_pending
        + limits.http_max_connections
        + limits.peer_max_connections
        + limits.peer_max_handshakes
        + segments
        + BASE_DESCRIPTORS
    )


def _text(limit: int) -> str:
    return "unlimited" if limit == UNLIMITED else str(limit)


def check_nofile(config: DaemonConfig, limits: tuple[int, int] | None = None) -> CheckResult:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE) if limits is None else limits
    floor = descriptor_floor(config)
    values = (("soft", soft), ("hard", hard), ("needed", NOFILE_NEEDED), ("caps", floor))
    if soft == UNLIMITED or soft >= NOFILE_NEEDED:
        return CheckResult(
            "limits.nofile",
            Severity.OK,
            f"open files: soft {_text(soft)}, hard {_text(hard)}",
            values=values,
        )
    can_raise = hard == UNLIMITED or hard >= NOFILE_NEEDED
    raise_hard = (
        f"raise the hard limit to {NOFILE_NEEDED} (as root: LimitNOFILE={NOFILE_NEEDED} in the "
        f"unit, as daemons/kvfabric.service; `<user> - nofile {NOFILE_NEEDED}` in "
        f"/etc/security/limits.d/; docker: --ulimit nofile={NOFILE_NEEDED}:{NOFILE_NEEDED})"
    )
    fix = (
        f"ulimit -n {NOFILE_NEEDED} before `kvfabric serve` (systemd: LimitNOFILE={NOFILE_NEEDED})"
        if can_raise
        else raise_hard
    )
    if soft < floor:
        why = (
            f"below the {floor} descriptors the configured caps (limits.max_sessions, "
            "http_max_connections, peer_max_connections, ... and the SSD segments) can hold: "
            "the daemon fails with EMFILE before a cap refuses"
        )
    elif not can_raise:
        why = f"and the hard limit ({_text(hard)}) keeps it there"
    else:
        return CheckResult(
            "limits.nofile",
            Severity.WARN,
            f"open files: soft limit {soft} < {NOFILE_NEEDED} the daemon needs (hard "
            f"{_text(hard)}: it can be raised)",
            fix,
            values,
        )
    return CheckResult(
        "limits.nofile",
        Severity.ERROR,
        f"open files: soft limit {soft} < {NOFILE_NEEDED} the daemon needs, {why}",
        fix,
        values,
    )


def registered_bytes(config: DaemonConfig) -> int:
    """What the peer transport registers: every memory tier, plus the fp8 staging arena."""
    tiers = sum(t.capacity for t in config.store.tiers if t.kind in MEMORY_KINDS)
    return tiers + config.cluster.wire_staging_bytes


def unpinned(config: DaemonConfig, nixl_usable: bool) -> str:
    """Why nothing is pinned ("" when the daemon will register its memory with NIXL)."""
    cluster = config.cluster
    if cluster.index != "redis":
        return "the embedded index opens no peer transport"
    if cluster.transport == "socket":
        return "cluster.transport is socket"
    if cluster.transport == "auto":
        if config.security.tls_on("peer"):
            return "peer TLS is on: transport auto picks the socket backend"
        if not nixl_usable:
            return "NIXL is unavailable: transport auto picks the socket backend"
    return ""


def check_memlock(
    config: DaemonConfig, *, nixl_usable: bool, limit: int | None = None
) -> CheckResult:
    """``nixl_usable``: whether NIXL works here (:func:`kvfabric.doctor.transport.probe_nixl`)."""
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    need = registered_bytes(config)
    shown = "unlimited" if soft == UNLIMITED else format_size(soft)
    values = (("soft", soft), ("needed", need))
    why_not = unpinned(config, nixl_usable)
    if why_not:
        return CheckResult(
            "limits.memlock",
            Severity.INFO,
            f"locked memory {shown}: nothing is pinned ({why_not})",
            values=values,
        )
    if soft == UNLIMITED or soft >= need:
        return CheckResult(
            "limits.memlock",
            Severity.OK,
            f"locked memory {shown} covers the {format_size(need)} NIXL registers",
            values=values,
        )
    return CheckResult(
        "limits.memlock",
        Severity.WARN,
        f"locked memory {shown} < the {format_size(need)} NIXL registers (memory tiers + "
        "cluster.wire_staging_bytes): UCX pins registered memory on an RDMA NIC, and "
        "registering beyond the limit fails there",
        "LimitMEMLOCK=infinity in the unit (as daemons/kvfabric.service), `ulimit -l "
        "unlimited` as root, or `<user> - memlock unlimited` in /etc/security/limits.d/",
        values,
    )
