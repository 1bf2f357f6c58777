"""TLS on the HTTP and TCP control planes of a real daemon: HTTPS works with the CA, plain
connections are refused, a certificate swapped on disk (or on SIGHUP) is served to new
connections, and with a client CA only clients holding a certificate get in; the client
library (Client) speaks TLS to the TCP plane and fails fast, typed, on a
certificate problem. Certificates are made at test time with the ``cryptography`` package
(tests/support/tls_certs.py)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest
from pipelined import PipelinedSession
from tls_certs import CA, client_context, serial_of

from kvfabric.client import Client, ClientTLS
from kvfabric.errors import AuthError, KVFabricError
from kvfabric.protocol.frames import FrameDecoder, encode_frame
from kvfabric.protocol.messages import Op, request


@pytest.fixture
def ca(tmp_path: Path) -> tuple[CA, Path]:
    authority = CA()
    return authority, authority.write(tmp_path / "ca.pem")


def served_serial(port: int, context: ssl.SSLContext) -> int:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return serial_of(tls.getpeercert(binary_form=True))


def tls_hello(port: int, context: ssl.SSLContext) -> dict:
    """A control-protocol hello over TLS, on a bare ``ssl`` socket."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(encode_frame(request(0, Op.HELLO, {"token": None, "client": "tls-test"})))
        decoder = FrameDecoder()
        while True:
            data = tls.recv(65536)
            assert data, "closed before the hello reply"
            for message in decoder.feed(data):
                return message


def test_https_and_tls_control_work_and_plain_connections_are_refused(
    start_daemon, tmp_path: Path, ca: tuple[CA, Path]
) -> None:
    """Regression: on the old code nothing had TLS (these settings did not exist)."""
    authority, ca_file = ca
    cert = tmp_path / "server.pem"
    authority.issue(cert, "node-a")
    daemon = start_daemon(f"security.tls_cert_file={cert}", "tcp.port=0")
    https = f"https://127.0.0.1:{daemon.info['http_port']}"
    context = client_context(ca_file)
    assert httpx.get(f"{https}/healthz", verify=context, timeout=5).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{daemon.http_url}/healthz", timeout=5)  # plain HTTP to the TLS port
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{https}/healthz", timeout=5)  # a client that does not trust the CA
    assert tls_hello(daemon.info["tcp_port"], context)["ok"] is True
    with pytest.raises(KVFabricError):  # the plain-TCP client library cannot get in
        Client(("127.0.0.1", daemon.info["tcp_port"]), timeout=3).ping()
    with Client(daemon.socket) as local:  # the Unix socket is not a TLS plane
        local.ping()


def test_a_certificate_swapped_on_disk_or_on_sighup_is_served_to_new_connections(
    start_daemon, tmp_path: Path, ca: tuple[CA, Path]
) -> None:
    authority, ca_file = ca
    cert = tmp_path / "server.pem"
    first = authority.issue(cert, "node-a")
    daemon = start_daemon(
        f"security.tls_cert_file={cert}", "security.tls_reload_s=0.2", "tcp.port=0"
    )
    http_port, tcp_port = daemon.info["http_port"], daemon.info["tcp_port"]
    context = client_context(ca_file)
    assert served_serial(http_port, context) == first
    second = authority.issue(cert, "node-a")  # picked up by the mtime check
    deadline = time.monotonic() + 5
    while served_serial(http_port, context) != second:
        assert time.monotonic() < deadline, "the new certificate was not picked up"
        time.sleep(0.1)
    assert served_serial(tcp_port, context) == second
    assert "TLS certificate reloaded" in daemon.read_log()
    (tmp_path / "broken.pem").write_text("not a certificate")
    os.replace(tmp_path / "broken.pem", cert)  # a bad file: the old certificate stays
    time.sleep(0.6)
    assert served_serial(http_port, context) == second
    assert "reload failed" in daemon.read_log()
    third = authority.issue(cert, "node-a")
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while served_serial(http_port, context) != third:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_with_a_client_ca_only_clients_with_a_certificate_get_in(
    start_daemon, tmp_path: Path, ca: tuple[CA, Path]
) -> None:
    authority, ca_file = ca
    cert, client_cert = tmp_path / "server.pem", tmp_path / "client.pem"
    authority.issue(cert, "node-a")
    authority.issue(client_cert, "router", server=False)
    daemon = start_daemon(
        f"security.tls_cert_file={cert}", f"security.tls_client_ca_file={ca_file}"
    )
    https = f"https://127.0.0.1:{daemon.info['http_port']}/healthz"
    assert (
        httpx.get(https, verify=client_context(ca_file, client_cert), timeout=5).status_code == 200
    )
    with pytest.raises(httpx.HTTPError):
        httpx.get(https, verify=client_context(ca_file), timeout=5)


def test_tls_lets_a_non_loopback_bind_start_only_with_auth(
    start_daemon, tmp_path: Path, ca: tuple[CA, Path]
) -> None:
    """TLS encrypts; it is not authentication: the bind rule still wants tokens."""
    authority, _ = ca
    cert = tmp_path / "server.pem"
    authority.issue(cert, "node-a")
    with pytest.raises(RuntimeError, match="refusing to listen beyond loopback"):
        start_daemon(f"security.tls_cert_file={cert}", "http.host=0.0.0.0")
    start_daemon(f"security.tls_cert_file={cert}", "http.host=0.0.0.0", "auth.token=admin-secret")


def test_the_client_library_speaks_tls_to_the_tcp_plane(
    start_daemon, tmp_path: Path, ca: tuple[CA, Path]
) -> None:
    """Regression: on the old code the client library had no TLS option, so no remote tool
    (and no peer daemon) could reach a TLS control endpoint."""
    authority, ca_file = ca
    cert = tmp_path / "server.pem"
    authority.issue(cert, "node-a")
    daemon = start_daemon(
        f"security.tls_cert_file={cert}", "tcp.port=0", "auth.token=admin-secret", "node_id=node-a"
    )
    address = ("127.0.0.1", daemon.info["tcp_port"])
    with Client(address, token="admin-secret", tls=ClientTLS(ca_file=str(ca_file))) as remote:
        remote.ping()
        assert "tiers" in remote.stats() and remote.node_id == "node-a"
    with Client(address, token="admin-secret", tls=client_context(ca_file)) as remote:
        remote.ping()  # a ready ssl.SSLContext works too

    with PipelinedSession(
        address, token="admin-secret", tls=ClientTLS(ca_file=str(ca_file))
    ) as pipelined:  # requests in flight together over TLS, answered by id
        replies = pipelined.call_all([(Op.PING, {})] * 8 + [(Op.STATS, {})])
        assert replies[:8] == ["pong"] * 8 and "tiers" in replies[8]
    # a name the certificate does not carry, a CA that did not sign it: refused at once
    # (typed, not retried until the timeout)
    started = time.monotonic()
    with pytest.raises(AuthError, match="not trusted"):
        Client(
            address,
            token="admin-secret",
            timeout=10,
            reconnect=False,
            tls=ClientTLS(ca_file=str(ca_file), server_name="elsewhere.example"),
        )
    other = tmp_path / "other-ca.pem"
    CA("another CA").write(other)
    with pytest.raises(AuthError, match="not trusted"):
        Client(address, timeout=10, reconnect=False, tls=ClientTLS(ca_file=str(other)))
    assert time.monotonic() - started < 5


def test_with_a_client_ca_the_client_library_needs_its_certificate(
    start_daemon, tmp_path: Path, ca: tuple[CA, Path]
) -> None:
    """Mutual TLS on the TCP plane: the client's certificate (and key, here in the same
    file) gets it in; none, or one from another CA, is an AuthError at once."""
    authority, ca_file = ca
    cert, client_cert, foreign = (
        tmp_path / name for name in ("server.pem", "client.pem", "foreign.pem")
    )
    authority.issue(cert, "node-a")
    authority.issue(client_cert, "tool", server=False)
    CA("another CA").issue(foreign, "intruder", server=False)
    daemon = start_daemon(
        f"security.tls_cert_file={cert}", "tcp.port=0", f"security.tls_client_ca_file={ca_file}"
    )
    address = ("127.0.0.1", daemon.info["tcp_port"])
    with Client(address, tls=ClientTLS(ca_file=str(ca_file), cert_file=str(client_cert))) as remote:
        remote.ping()
    started = time.monotonic()
    for tls in (
        ClientTLS(ca_file=str(ca_file)),
        ClientTLS(ca_file=str(ca_file), cert_file=str(foreign)),
    ):
        with pytest.raises(AuthError, match="refuses this client.s certificate"):
            Client(address, timeout=10, reconnect=False, tls=tls)
    assert time.monotonic() - started < 5
