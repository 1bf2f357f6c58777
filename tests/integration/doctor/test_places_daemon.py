"""A running kvfabric daemon on the configured socket and HTTP port is recognised as one
(info: serve would refuse a second), not as a foreign program."""

from __future__ import annotations

from pathlib import Path

from daemon_process import DaemonProcess

from kvfabric.config import load_config
from kvfabric.doctor import places
from kvfabric.doctor.result import Severity


def test_a_running_daemon_is_recognised(tmp_path: Path, start_daemon) -> None:
    daemon: DaemonProcess = start_daemon()
    config = load_config(
        env={},
        overrides=[
            f"socket_path={daemon.socket}",
            f"http.port={daemon.info['http_port']}",
            f"store.data_dir={tmp_path / 'other'}",
        ],
    )
    http = places.check_port(config, "http")
    assert http.severity is Severity.INFO, http
    assert "served by a kvfabric daemon" in http.message
    assert f"node {daemon.info['node_id']}" in http.message
    sock = places.check_socket(config)
    assert sock.severity is Severity.INFO and "answers" in sock.message
