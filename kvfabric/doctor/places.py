"""Where the daemon listens: the control socket's directory and path, the HTTP (and TCP
control) port.

Contract: each ``check_*`` returns one :class:`~kvfabric.doctor.result.CheckResult`,
never raising; nothing is created, bound for longer than a probe, or removed.

* ``places.socket_dir``: the socket's directory (absent: whether ``serve`` can create it).
  Others may write it without the sticky bit: error (anyone on the node can replace the
  socket and pose as the daemon to the engines); with it (``/tmp``): warning (anyone can take
  the name first); group-writable, or owned by another non-root user: warning (they can
  replace it); not writable by this user: error;
* ``places.socket``: the path fits ``sockaddr_un`` (107 bytes), and what is there: nothing
  (ok), something else than a socket (error), a socket something answers on (info: ``serve``
  refuses to start a second daemon), a stale socket (info: ``serve`` replaces it; error when
  this user could not remove it);
* ``places.http_port`` / ``places.tcp_port``: the port can be bound (ok), is served by a
  kvfabric daemon (``GET /healthz`` answers as one: info), by something else (error), or
  cannot be bound at all (error).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import ssl
import stat
import urllib.request
from pathlib import Path

from kvfabric.config import DaemonConfig
from kvfabric.doctor.result import CheckResult, Severity
from kvfabric.preflight import _answers, _check_port, _unwritable

SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, with the terminating NUL
PROBE_TIMEOUT_S = 2.0
OWN_DIR = "a directory of the daemon's own, mode 0750 (systemd: RuntimeDirectory=kvfabric)"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_socket_dir(config: DaemonConfig) -> CheckResult:
    directory = Path(config.socket_path).absolute().parent
    if not directory.exists():
        problem = _unwritable(directory)
        if problem:
            return CheckResult(
                "places.socket_dir",
                Severity.ERROR,
                f"socket directory {directory}: {problem}",
                f"create it for the daemon's user: {OWN_DIR}",
            )
        return CheckResult(
            "places.socket_dir",
            Severity.OK,
            f"socket directory {directory} does not exist yet: serve creates it",
        )
    st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        return CheckResult(
            "places.socket_dir",
            Severity.ERROR,
            f"socket directory {directory} is not a directory",
            "set socket_path to a path inside a directory",
        )
    mode = stat.S_IMODE(st.st_mode)
    owner = _user(st.st_uid)
    described = f"{directory} mode {mode:04o}, owner {owner}, group {_group(st.st_gid)}"
    found: list[tuple[Severity, str, str]] = []
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        found.append(
            (
                Severity.ERROR,
                "anyone on the node can replace the socket and pose as the daemon",
                f"chmod o-w {directory}",
            )
        )
    elif mode & stat.S_IWOTH:
        found.append(
            (
                Severity.WARN,
                "anyone on the node can take the socket's name before the daemon does",
                f"put socket_path in {OWN_DIR}",
            )
        )
    if mode & stat.S_IWGRP:
        found.append(
            (
                Severity.WARN,
                "the group (the engines) can replace the socket",
                f"chmod g-w {directory}",
            )
        )
    if st.st_uid not in (0, os.geteuid()):
        found.append(
            (
                Severity.WARN,
                f"owned by {owner}, not this user: {owner} can replace the socket",
                f"chown {_user(os.geteuid())} {directory}",
            )
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        found.append(
            (
                Severity.ERROR,
                f"this user ({_user(os.geteuid())}) cannot create the socket there",
                f"chown {_user(os.geteuid())} {directory} (or run serve as its owner)",
            )
        )
    values = (("mode", f"{mode:04o}"), ("owner", owner))
    if not found:
        return CheckResult("places.socket_dir", Severity.OK, described, values=values)
    severity = max((s for s, _, _ in found), key=lambda s: s.rank)
    return CheckResult(
        "places.socket_dir",
        severity,
        f"{described}: " + "; ".join(why for _, why, _ in found),
        "; ".join(fix for _, _, fix in found),
        values,
    )


def check_socket(config: DaemonConfig) -> CheckResult:
    path = Path(config.socket_path)
    length = len(os.fsencode(config.socket_path))
    if length > SUN_PATH_MAX:
        return CheckResult(
            "places.socket",
            Severity.ERROR,
            f"socket_path is {length} bytes; a Unix socket path holds at most {SUN_PATH_MAX}",
            "use a shorter path, e.g. /run/kvfabric/kvfabric.sock",
        )
    if not (path.exists() or path.is_symlink()):
        return CheckResult(
            "places.socket", Severity.OK, f"{path.absolute()} is free: serve creates it (0660)"
        )
    if not path.is_socket():
        return CheckResult(
            "places.socket",
            Severity.ERROR,
            f"{path.absolute()} exists and is not a socket: serve will not start",
            "move it away, or set socket_path elsewhere",
        )
    if _answers(path):
        return CheckResult(
            "places.socket",
            Severity.INFO,
            f"a daemon answers on {path.absolute()}: serve refuses to start a second one there",
            "stop it first (systemctl stop kvfabric), or give this one another socket_path",
        )
    if not _removable(path):
        return CheckResult(
            "places.socket",
            Severity.ERROR,
            f"{path.absolute()} is a stale socket (nothing answers) that this user "
            "cannot remove: serve will fail to bind",
            f"rm {path.absolute()} as its owner ({_user(path.lstat().st_uid)})",
        )
    return CheckResult(
        "places.socket",
        Severity.INFO,
        f"{path.absolute()} is a stale socket (nothing answers; left by a daemon that did not "
        "exit cleanly): serve replaces it",
        "",
    )


def _removable(path: Path) -> bool:
    """Whether this user may unlink ``path`` (directory writable; sticky: owner only)."""
    parent = path.absolute().parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return False
    euid = os.geteuid()
    if euid == 0 or not parent.stat().st_mode & stat.S_ISVTX:
        return True
    return euid in (path.lstat().st_uid, parent.stat().st_uid)


def check_port(config: DaemonConfig, plane: str) -> CheckResult:
    """``plane``: "http" or "tcp"."""
    endpoint = config.http if plane == "http" else config.tcp
    name = f"places.{plane}_port"
    key = f"{plane}.port"
    if endpoint.port is None:
        return CheckResult(name, Severity.OK, f"{plane} listener off ({key}: null)")
    where = f"{endpoint.host}:{endpoint.port}"
    if endpoint.port == 0:
        return CheckResult(name, Severity.OK, f"{plane} on {endpoint.host}, any free port")
    problems: list[str] = []
    _check_port(plane, endpoint.host, endpoint.port, problems)
    if not problems:
        return CheckResult(name, Severity.OK, f"{plane} {where} is free")
    if not problems[0].endswith("in use"):
        return CheckResult(
            name, Severity.ERROR, problems[0], f"set {plane}.host to an address of this host"
        )
    daemon = _kvfabric_at(endpoint.host, endpoint.port, config.security.tls_on(plane))
    if plane == "http" and daemon:
        return CheckResult(
            name,
            Severity.INFO,
            f"{where} is served by a kvfabric daemon ({daemon}): serve refuses to start a "
            "second one on it",
            f"stop it first (systemctl stop kvfabric), or give this one another {key}",
        )
    return CheckResult(
        name,
        Severity.ERROR,
        f"{where} is in use by another program: serve will not start",
        f"find it with `ss -ltnp 'sport = :{endpoint.port}'`, or set {key} to a free port",
    )


def _kvfabric_at(host: str, port: int, tls: bool) -> str:
    """``node X, up N s`` when a kvfabric daemon's ``/healthz`` answers there, else ""."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host.strip('[]')}]"
    context = None
    if tls:  # identifying it, not trusting it: nothing is sent but the request line
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    url = f"{'https' if tls else 'http'}://{host}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S, context=context) as response:
            health = json.load(response)
    except (OSError, ValueError):
        return ""
    if not isinstance(health, dict) or not {"node_id", "uptime_s", "status"} <= set(health):
        return ""
    return f"node {health['node_id']}, up {float(health['uptime_s']):.0f} s"
