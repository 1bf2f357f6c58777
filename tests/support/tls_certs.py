"""A throwaway certificate authority for TLS tests: certificates are made at test time with
the ``cryptography`` package (EC P-256, valid for a day, SANs ``localhost`` and
``127.0.0.1`` on server certificates), never committed."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class CA:
    def __init__(self, name: str = "kvfabric test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .issuer_name(self.name)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(self.key, hashes.SHA256())
        )

    @staticmethod
    def _builder(subject: x509.Name, public_key: object) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def issue(self, path: Path, common_name: str, *, server: bool = True) -> int:
        """A leaf certificate and its key in one PEM file at ``path``; returns its serial.
        Server certificates name ``localhost`` and ``127.0.0.1`` (and serve as client
        certificates too: no extended key usage, as a node's certificate toward peers)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = self._builder(subject, key.public_key()).issuer_name(self.name)
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                False,
            )
        cert = builder.sign(self.key, hashes.SHA256())
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        os.replace(tmp, path)  # atomically, as an operator's tooling would
        return cert.serial_number

    def write(self, path: Path) -> Path:
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path


def serial_of(der: bytes | None) -> int:
    """The serial number of a DER certificate (``getpeercert(binary_form=True)``)."""
    assert der is not None, "no certificate"
    return x509.load_der_x509_certificate(der).serial_number


def server_context(cert: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert))
    if client_ca is not None:
        context.load_verify_locations(cafile=str(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(ca_file: Path, cert: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_file))
    if cert is not None:
        context.load_cert_chain(str(cert))
    return context
