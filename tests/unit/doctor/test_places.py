"""The socket's directory and path, and the ports: real directories with real modes and
owners, real sockets and listeners."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.config import DaemonConfig, load_config
from kvfabric.doctor import places
from kvfabric.doctor.result import Severity


def _config(tmp_path: Path, *settings: str) -> DaemonConfig:
    return load_config(env={}, overrides=[f"store.data_dir={tmp_path / 'data'}", *settings])


def _socket_in(tmp_path: Path, mode: int) -> DaemonConfig:
    directory = tmp_path / "run"
    directory.mkdir(exist_ok=True)
    directory.chmod(mode)
    return _config(tmp_path, f"socket_path={directory / 'kvfabric.sock'}")


@pytest.mark.parametrize(
    ("mode", "severity", "fix"),
    [
        (0o750, Severity.OK, ""),
        (0o700, Severity.OK, ""),
        (0o770, Severity.WARN, "chmod g-w"),
        (0o1777, Severity.WARN, "RuntimeDirectory"),
        (0o777, Severity.ERROR, "chmod o-w"),
        (0o757, Severity.ERROR, "chmod o-w"),
    ],
)
def test_socket_dir_permissions(tmp_path: Path, mode: int, severity: Severity, fix: str) -> None:
    result = places.check_socket_dir(_socket_in(tmp_path, mode))
    assert result.severity is severity, result
    assert f"mode {mode:04o}" in result.message
    assert fix in result.fix


def test_a_socket_dir_owned_by_another_user_is_a_warning(tmp_path: Path) -> None:
    config = _socket_in(tmp_path, 0o750)
    try:
        os.chown(tmp_path / "run", 65534, 65534)
    except PermissionError:
        pytest.skip("chown needs root")
    result = places.check_socket_dir(config)
    assert result.severity is Severity.WARN
    assert "can replace the socket" in result.message and "chown" in result.fix


def test_a_missing_socket_dir_is_created_by_serve(tmp_path: Path) -> None:
    result = places.check_socket_dir(_config(tmp_path))
    assert result.severity is Severity.OK and "serve creates it" in result.message


def test_a_socket_path_under_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = places.check_socket_dir(_config(tmp_path, f"socket_path={tmp_path}/file/s.sock"))
    assert result.severity is Severity.ERROR


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    path = tmp_path / "kvfabric.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    yield sock, path
    sock.close()


def test_a_stale_socket_is_reported_and_replaceable(
    tmp_path: Path, unix_socket: tuple[socket.socket, Path]
) -> None:
    sock, path = unix_socket
    sock.close()  # the file stays: what a killed daemon leaves
    result = places.check_socket(_config(tmp_path, f"socket_path={path}"))
    assert result.severity is Severity.INFO
    assert "stale socket" in result.message and "serve replaces it" in result.message


def test_a_socket_something_answers_on(
    tmp_path: Path, unix_socket: tuple[socket.socket, Path]
) -> None:
    sock, path = unix_socket
    sock.listen(1)
    result = places.check_socket(_config(tmp_path, f"socket_path={path}"))
    assert result.severity is Severity.INFO and "answers" in result.message


def test_a_file_in_the_sockets_place_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "kvfabric.sock").write_text("")
    result = places.check_socket(_config(tmp_path, f"socket_path={tmp_path}/kvfabric.sock"))
    assert result.severity is Severity.ERROR and "not a socket" in result.message


def test_a_socket_path_too_long_for_sockaddr_un_is_an_error(tmp_path: Path) -> None:
    long_path = tmp_path / ("d" * 120) / "kvfabric.sock"
    result = places.check_socket(_config(tmp_path, f"socket_path={long_path}"))
    assert result.severity is Severity.ERROR and "107" in result.message


def test_a_free_socket_path_is_ok(tmp_path: Path) -> None:
    assert places.check_socket(_config(tmp_path)).severity is Severity.OK


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_http_port_free_occupied_or_off(tmp_path: Path) -> None:
    with _listener() as busy:
        port = busy.getsockname()[1]
        taken = places.check_port(_config(tmp_path, f"http.port={port}"), "http")
        assert taken.severity is Severity.ERROR
        assert "another program" in taken.message and f"sport = :{port}" in taken.fix
    free = places.check_port(_config(tmp_path, f"http.port={port}"), "http")
    assert free.severity is Severity.OK and "is free" in free.message
    off = places.check_port(_config(tmp_path, "http.port=null"), "http")
    assert off.severity is Severity.OK and "off" in off.message


def test_a_host_that_is_not_this_machines_is_an_error(tmp_path: Path) -> None:
    # TEST-NET-1 (RFC 5737): never an address of this host
    config = _config(
        tmp_path, "http.host=192.0.2.1", "http.port=8790", "security.allow_insecure=true"
    )
    result = places.check_port(config, "http")
    assert result.severity is Severity.ERROR and "http.host" in result.fix
