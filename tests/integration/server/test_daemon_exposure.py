"""The bind rule on real daemons: a plane bound beyond loopback without authentication is
refused at start, unless security.allow_insecure (--insecure) says so, and then it is said
loudly (a WARNING in the log, ``warnings`` in /healthz and /v1/stats). Binding 0.0.0.0 is
fine in tests: they connect over loopback only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvfabric.client import Client

ANY = "0.0.0.0"
EXIT_USAGE = 2


def serve(tmp_path: Path, *settings: str, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "kvfabric.cli",
        "serve",
        "--data-dir",
        str(tmp_path),
        "--http-port",
        "0",
        *flags,
    ]
    for item in settings:
        args += ["--set", item]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize(
    "settings, plane",
    [
        ((f"http.host={ANY}",), "HTTP on 0.0.0.0"),
        ((f"tcp.host={ANY}", "tcp.port=0"), "TCP control on 0.0.0.0"),
        # tokens on, but no cluster secret: the peer transport would hand out the arenas
        (
            (
                f"tcp.host={ANY}",
                "tcp.port=0",
                "auth.token=admin-secret",
                "cluster.index=redis",
                "cluster.redis_url=redis://127.0.0.1:1/0",
            ),
            "peer transport on 0.0.0.0",
        ),
    ],
)
def test_a_non_loopback_bind_without_auth_is_refused(
    tmp_path: Path, settings: tuple[str, ...], plane: str
) -> None:
    """Regression: on the old code each of these started, silently, and gave anyone who
    reached the port admin rights (HTTP, TCP control) or the arenas (peer transport)."""
    proc = serve(tmp_path, *settings)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_USAGE, out
    assert "refusing to listen beyond loopback without authentication" in out
    assert plane in out and "security.allow_insecure" in out
    assert not (tmp_path / "kvfabric.sock").exists()  # refused before anything listened


def test_with_auth_a_non_loopback_bind_starts_without_warnings(start_daemon) -> None:
    daemon = start_daemon(
        f"http.host={ANY}", f"tcp.host={ANY}", "tcp.port=0", "auth.token=admin-secret"
    )
    health = httpx.get(f"{daemon.http_url}/healthz", timeout=10).json()
    assert health["warnings"] == []
    assert "INSECURE" not in daemon.read_log()


def test_allow_insecure_starts_and_says_so_loudly(start_daemon) -> None:
    """Regression: on the old code nothing (log, health, stats) said the daemon was open."""
    daemon = start_daemon(
        f"http.host={ANY}", f"tcp.host={ANY}", "tcp.port=0", "security.allow_insecure=true"
    )
    log = daemon.read_log()
    assert "WARNING" in log and "INSECURE: HTTP on 0.0.0.0" in log
    assert "INSECURE: TCP control on 0.0.0.0" in log
    health = httpx.get(f"{daemon.http_url}/healthz", timeout=10).json()
    assert len(health["warnings"]) == 2 and all("INSECURE" in w for w in health["warnings"])
    stats = httpx.get(f"{daemon.http_url}/v1/stats", timeout=10).json()
    assert stats["warnings"] == health["warnings"]
    with Client(("127.0.0.1", daemon.info["tcp_port"])) as remote:  # what an outsider gets
        remote.ping()


def test_the_insecure_flag_is_the_setting(tmp_path: Path) -> None:
    proc = serve(tmp_path, f"http.host={ANY}", flags=("--insecure", "--print-config"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "allow_insecure: true" in out
