"""Client-side TLS for TCP sessions: remote tooling, and the daemon's links to its peers.

Contract: a TCP address may come with a TLS option, either a :class:`ClientTLS` (files) or a
ready ``ssl.SSLContext`` (the daemon passes its own, reloaded with its certificate).
:class:`ClientTLS` says how to reach a daemon whose TCP control plane serves TLS
(``security.tls_planes`` with ``tcp``): ``ca_file`` is the CA its certificate is checked
against (None: the system's trust store), ``cert_file`` / ``key_file`` this client's
certificate for a daemon that requires one (``security.tls_client_ca_file``: mutual TLS;
the key may sit in the certificate's file), ``server_name`` the name the daemon's
certificate must carry (default: the host of the address). TLS 1.2 or newer; the
certificate chain and the name are always checked. :meth:`ClientTLS.context` reads the files
each time it is called, so a client that reconnects after a rotation presents the new
certificate. Unix-socket addresses ignore the option (local only).

Failures are typed (:func:`failure`): files that cannot be loaded are a ConfigError; a
daemon whose certificate is not trusted, one that refuses ours (or a listener that does not
speak TLS) an AuthError, which connecting does not retry; a TLS session the daemon closes
properly (``close_notify``: a daemon shedding load) an UnavailableError, retried like any busy
daemon. The daemon's TLS stack (asyncio's, uvloop's) drops the alert when it refuses a
client certificate and just closes the TCP connection, so the blocking client reads an EOF
without ``close_notify`` before the hello reply as that refusal (AuthError, not retried); the
asyncio client cannot tell the two closes apart and retries it until its timeout.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass

from kvfabric.errors import (
    AuthError,
    ConfigError,
    DeadlineExceededError,
    KVFabricError,
    UnavailableError,
)


@dataclass(frozen=True)
class ClientTLS:
    """TLS settings of a client (see the module docstring)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file", "server_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"ClientTLS.{name} must be a non-empty string or None")
        if self.key_file is not None and self.cert_file is None:
            raise ConfigError("ClientTLS.key_file needs cert_file")

    def context(self) -> ssl.SSLContext:
        """A fresh client context from the files (ConfigError if one does not load)."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.cert_file is not None:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"client TLS: cannot load the CA or certificate: {exc}") from None
        return context


TLSOption = ClientTLS | ssl.SSLContext | None


def resolve(tls: ClientTLS | ssl.SSLContext, host: str) -> tuple[ssl.SSLContext, str]:
    """The context to use and the name the server's certificate must carry."""
    if isinstance(tls, ClientTLS):
        return tls.context(), tls.server_name or host
    if isinstance(tls, ssl.SSLContext):
        return tls, host
    raise ConfigError(f"tls must be a ClientTLS or an ssl.SSLContext, got {type(tls).__name__}")


def wrap(
    sock: socket.socket, tls: ClientTLS | ssl.SSLContext, host: str, deadline: float
) -> ssl.SSLSocket:
    """TLS over the connected ``sock``, handshake done before ``deadline`` (monotonic).
    ``sock`` is consumed: closed on failure."""
    try:
        context, name = resolve(tls, host)
        # ragged EOFs raise: they tell a refused certificate from a close (see above)
        secured = context.wrap_socket(
            sock, server_hostname=name, do_handshake_on_connect=False, suppress_ragged_eofs=False
        )
    except BaseException:
        sock.close()
        raise
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError("TLS handshake: deadline exceeded")
        secured.settimeout(left)
        secured.do_handshake()
        return secured
    except BaseException as exc:
        secured.close()
        if isinstance(exc, KVFabricError):
            raise
        if isinstance(exc, socket.timeout):
            raise DeadlineExceededError(
                f"TLS handshake with {host}: no answer before the deadline"
            ) from None
        if isinstance(exc, ssl.SSLError):
            raise failure(exc, host) from None
        if isinstance(exc, OSError):
            raise UnavailableError(f"TLS handshake with {host} failed: {exc}") from None
        raise


def failure(exc: ssl.SSLError, where: str) -> KVFabricError:
    """The typed error for a TLS failure talking to ``where``."""
    if isinstance(exc, ssl.SSLZeroReturnError):
        return UnavailableError(f"{where} closed the TLS connection")
    if isinstance(exc, ssl.SSLEOFError):
        return AuthError(
            f"{where} dropped the TLS connection without a word: it refuses this "
            "client's certificate (none given, or not signed by its "
            "security.tls_client_ca_file), or it stopped"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return AuthError(
            f"the TLS certificate of {where} is not trusted: {exc.verify_message or exc}"
        )
    # an alert from the server (our certificate refused, no common protocol) or a listener
    # that does not speak TLS ("wrong version number")
    return AuthError(f"TLS with {where} failed: {exc.reason or exc}")


def hung_up(sock: socket.socket) -> bool:
    """Whether a readable idle socket is really the peer's hang-up: on a TLS socket,
    handshake records sent after it (session tickets) make it readable too."""
    if not isinstance(sock, ssl.SSLSocket):
        return True
    timeout = sock.gettimeout()
    try:
        sock.settimeout(0)
        sock.recv(1)  # bytes nobody asked for, or b"" (closed): either way the session ends
        return True
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return False
    except OSError:
        return True
    finally:
        try:
            sock.settimeout(timeout)
        except OSError:
            pass
