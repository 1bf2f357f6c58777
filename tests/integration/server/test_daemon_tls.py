"""TLS on the HTTP and TCP control planes of a real daemon: HTTPS works with the CA, plain
connections are refused, a certificate swapped on disk (or on SIGHUP) is served to new
connections, and with a client CA only clients holding a certificate get in. Certificates
are made at test time with the ``cryptography`` package."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvfabric.client import Client
from kvfabric.protocol.frames import FrameDecoder, encode_frame
from kvfabric.protocol.messages import Op, request


class CA:
    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfabric test CA")])
        self.name = name
        self.cert = (self._builder(name, self.key.public_key()).issuer_name(name)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))

    @staticmethod
    def _builder(subject: x509.Name, public_key: object) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (x509.CertificateBuilder().subject_name(subject).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def issue(self, path: Path, common_name: str, *, server: bool = True) -> int:
        """A leaf certificate and its key in one PEM file at ``path``; returns its serial."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = self._builder(subject, key.public_key()).issuer_name(self.name)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                False)
        cert = builder.sign(self.key, hashes.SHA256())
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        os.replace(tmp, path)  # atomically, as an operator's tooling would
        return cert.serial_number

    def write(self, path: Path) -> Path:
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path


@pytest.fixture
def ca(tmp_path: Path) -> tuple[CA, Path]:
    authority = CA()
    return authority, authority.write(tmp_path / "ca.pem")


def client_context(ca_file: Path, cert: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_file))
    if cert is not None:
        context.load_cert_chain(str(cert))
    return context


def served_serial(port: int, context: ssl.SSLContext) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def tls_hello(port: int, context: ssl.SSLContext) -> dict:
    """A control-protocol hello over TLS (the client library speaks plain TCP only)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(encode_frame(request(0, Op.HELLO, {"token": None, "client": "tls-test"})))
        decoder = FrameDecoder()
        while True:
            data = tls.recv(65536)
            assert data, "closed before the hello reply"
            for message in decoder.feed(data):
                return message


def test_https_and_tls_control_work_and_plain_connections_are_refused(
        start_daemon, tmp_path: Path, ca: tuple[CA, Path]) -> None:
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
    with pytest.raises(Exception):  # the plain-TCP client library cannot get in
        Client(("127.0.0.1", daemon.info["tcp_port"]), timeout=3).ping()
    with Client(daemon.socket) as local:  # the Unix socket is not a TLS plane
        local.ping()


def test_a_certificate_swapped_on_disk_or_on_sighup_is_served_to_new_connections(
        start_daemon, tmp_path: Path, ca: tuple[CA, Path]) -> None:
    authority, ca_file = ca
    cert = tmp_path / "server.pem"
    first = authority.issue(cert, "node-a")
    daemon = start_daemon(f"security.tls_cert_file={cert}", "security.tls_reload_s=0.2",
                          "tcp.port=0")
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
        start_daemon, tmp_path: Path, ca: tuple[CA, Path]) -> None:
    authority, ca_file = ca
    cert, client_cert = tmp_path / "server.pem", tmp_path / "client.pem"
    authority.issue(cert, "node-a")
    authority.issue(client_cert, "router", server=False)
    daemon = start_daemon(f"security.tls_cert_file={cert}",
                          f"security.tls_client_ca_file={ca_file}")
    https = f"https://127.0.0.1:{daemon.info['http_port']}/healthz"
    assert httpx.get(https, verify=client_context(ca_file, client_cert),
                     timeout=5).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(https, verify=client_context(ca_file), timeout=5)


def test_tls_lets_a_non_loopback_bind_start_only_with_auth(
        start_daemon, tmp_path: Path, ca: tuple[CA, Path]) -> None:
    """TLS encrypts; it is not authentication: the bind rule still wants tokens."""
    authority, _ = ca
    cert = tmp_path / "server.pem"
    authority.issue(cert, "node-a")
    with pytest.raises(RuntimeError, match="refusing to listen beyond loopback"):
        start_daemon(f"security.tls_cert_file={cert}", "http.host=0.0.0.0")
    start_daemon(f"security.tls_cert_file={cert}", "http.host=0.0.0.0",
                 "auth.token=admin-secret")
