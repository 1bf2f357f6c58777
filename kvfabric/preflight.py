"""Checks ``kvfabric serve`` runs on a config before it builds anything (``serve --check``
runs them alone).

Contract: :func:`preflight` raises :class:`~kvfabric.errors.ConfigError` with every problem
it found (one message; several problems one per line), or returns a :class:`Preflight`: what
the daemon will use, as lines to print, plus warnings. Nothing is created, bound or
written: directories and ports are probed, not taken. What it checks, in the order the
daemon would meet it:

* credentials: ``auth.token_file`` readable and not empty (an empty file would turn
  authentication off without a word), ``cluster.secret_file`` readable and long enough (the
  daemon reads it only after the store is built), the TLS certificate loadable;
* the bind rule (:func:`kvfabric.config.check_binds`) and what the redis index needs (the
  TCP control endpoint);
* pages: what backs the memory tiers' arenas (reserved huge pages, or the kernel's page
  size for shared memory, with what to change where it is 4 KiB); ``huge_pages: on``
  without enough reserved huge pages free is refused;
* capacities: the memory tiers (DRAM, CXL) against physical memory (``MemTotal``, or the
  cgroup's ``memory.max`` when lower), the prefaulted ones against what is available now
  (``MemAvailable``: prefault touches every page at start-up); an SSD tier against the free
  space of its filesystem plus what its directory holds already. ``store.allow_overcommit``
  turns these refusals into warnings;
* places: the data dir and the socket's directory can be created and written; with
  ``probe`` (what ``serve`` and ``--check`` do, not ``--print-config``: these depend on what
  else runs at the moment, not on the config) no other daemon answers on the socket and the
  HTTP and TCP ports can be bound.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from kvfabric.config import DaemonConfig, check_binds
from kvfabric.errors import ConfigError
from kvfabric.memory import pagesize
from kvfabric.store.config import TierConfig, format_size
from kvfabric.tiers.base import TierKind

MEMORY_KINDS = (TierKind.DRAM, TierKind.CXL)


@dataclass(frozen=True)
class MemoryInfo:
    """What the machine (or the cgroup the daemon runs in) has, in bytes."""

    total: int
    available: int
    source: str  # "physical RAM" or "the cgroup's memory.max"


@dataclass(frozen=True)
class Preflight:
    """What the daemon will use (``lines``) and what it will warn about: ``warnings``
    (capacities accepted by ``store.allow_overcommit``; the caller logs them) and
    ``insecure`` (planes ``security.allow_insecure`` exposes; the daemon logs them)."""

    lines: tuple[str, ...]
    warnings: tuple[str, ...]
    insecure: tuple[str, ...] = ()


def preflight(config: DaemonConfig, *, probe: bool = True) -> Preflight:
    problems: list[str] = []
    warnings: list[str] = []
    insecure: list[str] = []
    lines: list[str] = [
        f"node id      {config.node_id}",
        f"socket       {Path(config.socket_path).absolute()}",
    ]
    auth_on = _check_credentials(config, problems)
    lines.append(
        "auth         " + ("on" if auth_on else "off (no tokens: loopback listeners only)")
    )
    try:
        insecure += check_binds(config)
    except ConfigError as exc:
        problems.append(str(exc))
    if config.cluster.index == "redis" and config.tcp.port is None:
        problems.append(
            "cluster.index redis needs the TCP control endpoint (tcp.port; 0 "
            "picks a free port): peers pull this node's chunks through it"
        )
    overcommit: list[str] = []
    lines += _check_memory(config, overcommit)
    lines += _check_pages(config, problems, probe)
    lines += _check_disk(config, overcommit)
    if config.store.allow_overcommit:
        warnings += [f"{line} (store.allow_overcommit is set)" for line in overcommit]
    else:
        problems += [
            f"{line}; lower the capacity, or set store.allow_overcommit: true to start anyway"
            for line in overcommit
        ]
    _check_places(config, problems, probe)
    for name, endpoint in (("http", config.http), ("tcp", config.tcp)):
        if endpoint.port is not None:
            if probe:
                _check_port(name, endpoint.host, endpoint.port, problems)
            lines.append(f"{name:12} {endpoint.host}:{endpoint.port}")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:  # one per line: a new config often has several at once
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return Preflight(tuple(lines), tuple(warnings), tuple(insecure))


# -- credentials ------------------------------------------------------------------------


def _check_credentials(config: DaemonConfig, problems: list[str]) -> bool:
    auth_on = False
    try:
        auth_on = config.auth.enabled
        if config.auth.token_file and not config.auth.token and not config.auth.admin_token:
            problems.append(
                f"auth.token_file {config.auth.token_file} is empty (authentication "
                "would be off); `kvfabric token new FILE` writes one"
            )
    except ConfigError as exc:
        problems.append(f"{exc} (`kvfabric token new FILE` writes a token file)")
    try:
        config.cluster.secret()
    except ConfigError as exc:
        problems.append(f"{exc} (`kvfabric token new FILE` writes a secret file)")
    security = config.security
    if security.tls_cert_file is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
            if security.tls_client_ca_file is not None:
                context.load_verify_locations(cafile=security.tls_client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            problems.append(f"security.tls_*: cannot load the certificate: {exc}")
    return auth_on


# -- capacities -------------------------------------------------------------------------


def memory_info() -> MemoryInfo:
    """Physical memory from /proc/meminfo, lowered to the cgroup v2 limit where one is set."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            words = rest.split()
            if words:
                fields[name] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    total = fields["MemTotal"]
    available = fields.get("MemAvailable", fields.get("MemFree", total))
    limit = _cgroup_memory_limit()
    if limit is not None and limit < total:
        return MemoryInfo(limit, min(available, limit), "the cgroup's memory.max")
    return MemoryInfo(total, available, "physical RAM")


def _cgroup_memory_limit() -> int | None:
    try:
        entries = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for entry in entries:
        hierarchy, _, path = entry.partition("::")
        if hierarchy == "0":  # cgroup v2: "0::/path"
            try:
                value = (
                    (Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max").read_text().strip()
                )
            except OSError:
                return None
            return int(value) if value.isdigit() else None
    return None


def _check_memory(config: DaemonConfig, overcommit: list[str]) -> list[str]:
    tiers = [t for t in config.store.tiers if t.kind in MEMORY_KINDS]
    if not tiers:
        return []
    info = memory_info()
    total = sum(t.capacity for t in tiers)
    prefaulted = sum(t.capacity for t in tiers if t.prefault)
    names = " + ".join(f"{t.name} {format_size(t.capacity)}" for t in tiers)
    if total > info.total:
        overcommit.append(
            f"the memory tiers ({names}) need {format_size(total)}, more than "
            f"the {format_size(info.total)} of {info.source} this machine has"
        )
    elif prefaulted > info.available:
        overcommit.append(
            f"the prefaulted memory tiers need {format_size(prefaulted)} now, "
            f"{format_size(info.available)} of memory is available (prefault: "
            "true touches every page at start-up)"
        )
    return [
        f"memory tiers {names}: {format_size(total)} of {format_size(info.total)} "
        f"{info.source}" + (f" ({format_size(prefaulted)} prefaulted)" if prefaulted else "")
    ]


def _check_pages(config: DaemonConfig, problems: list[str], probe: bool) -> list[str]:
    """What pages the memory tiers' arenas get: reserved huge pages (``huge_pages``), or
    what the kernel gives shared memory (with ``probe``: a small arena mapped and read
    back; else the settings alone). ``huge_pages: on`` without enough free is a problem."""
    tiers = [t for t in config.store.tiers if t.kind in MEMORY_KINDS and t.huge_pages != "off"]
    free = pagesize.hugetlb_free_bytes()
    wanted = sum(t.capacity for t in tiers if t.huge_pages == "on")
    if wanted > free:
        problems.append(
            f"huge_pages: on needs {format_size(wanted)} of reserved huge pages, "
            f"{format_size(free)} are free (sysctl vm.nr_hugepages)"
        )
    if any(t.capacity <= free for t in tiers):
        return [f"memory pages 2 MiB: reserved huge pages ({format_size(free)} free)"]
    pages = pagesize.describe() if probe else pagesize.SharedPages(0, "", 0)
    if pages.page_bytes >= 2 << 20:
        return [f"memory pages {pages.summary()}"]
    hint = (
        "engines' copies into the arenas walk 4 KiB pages: reserve huge pages "
        "(vm.nr_hugepages) or set /sys/kernel/mm/transparent_hugepage/shmem_enabled to "
        "advise for faster ones"
    )
    return [f"memory pages {pages.summary() if probe else 'not probed'}; {hint}"]


def ssd_dir(config: DaemonConfig, tier: TierConfig) -> Path:
    return Path(config.store.data_dir) / tier.path


def _check_disk(config: DaemonConfig, overcommit: list[str]) -> list[str]:
    lines = []
    for tier in config.store.tiers:
        if tier.kind is not TierKind.SSD:
            continue
        directory = ssd_dir(config, tier)
        held = _bytes_under(directory)
        free = shutil.disk_usage(_existing_ancestor(directory)).free
        if tier.capacity > free + held:
            overcommit.append(
                f"ssd tier {tier.name!r} asks for {format_size(tier.capacity)}, but "
                f"{directory} has {format_size(free)} free"
                + (f" (+ {format_size(held)} it holds already)" if held else "")
            )
        lines.append(
            f"{tier.name:12} ssd tier {format_size(tier.capacity)} in "
            f"{directory.absolute()} ({format_size(free)} free)"
        )
    return lines


def _bytes_under(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# -- places -----------------------------------------------------------------------------


def _check_places(config: DaemonConfig, problems: list[str], probe: bool) -> None:
    for what, directory in (
        ("store.data_dir", Path(config.store.data_dir)),
        ("socket_path's directory", Path(config.socket_path).parent),
    ):
        problem = _unwritable(directory)
        if problem:
            problems.append(f"{what} {directory}: {problem}")
    path = Path(config.socket_path)
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            problems.append(f"socket_path {path} exists and is not a socket")
        elif probe and _answers(path):
            problems.append(f"another daemon is already serving {path}")


def _unwritable(directory: Path) -> str | None:
    """Why ``directory`` cannot be used (created, then written), or None."""
    if directory.exists():
        if not directory.is_dir():
            return "exists and is not a directory"
        return None if os.access(directory, os.W_OK | os.X_OK) else "not writable by this user"
    ancestor = _existing_ancestor(directory)
    if not ancestor.is_dir():
        return f"cannot be created: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: {ancestor} is not writable by this user"
    return None


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False  # a stale socket file: the daemon replaces it
    finally:
        probe.close()
    return True


def _check_port(name: str, host: str, port: int, problems: list[str]) -> None:
    if port == 0:
        return  # any free port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon binds
        probe.bind((host, port))
    except OSError as exc:
        why = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        problems.append(f"{name} {host}:{port} cannot be bound: {why}")
    finally:
        probe.close()
