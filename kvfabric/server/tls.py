"""The daemon's TLS (HTTP, TCP control and the socket peer transport), with certificate reload.

Contract: :class:`ReloadingTLS` holds one ``ssl.SSLContext`` (TLS 1.2 or newer) that both
planes' listeners use for their whole life (with a client CA it requires client certificates
signed by it: mutual TLS). :meth:`ReloadingTLS.reload` builds a *new* context from the
certificate chain and key and swaps it in; the listeners' context hands every new connection
to the current one in its SNI callback (OpenSSL calls it for every ClientHello, with or without
a server name). Mutating the listeners' context in place instead would race with handshakes
running on other threads (a new certificate with the old key: failed handshakes). So
connections accepted afterwards get the new certificate and established ones keep theirs.
:meth:`reload_if_changed` does so when a file's
mtime, size or inode changed (a rename-into-place counts); the daemon calls it periodically
and on SIGHUP. A file that cannot be loaded leaves the previous certificate serving and is
logged (a half-written certificate must not take the plane down); at start-up it is a
:class:`~kvfabric.errors.ConfigError`. The client CA file is re-read with the certificate.

Toward peers (:mod:`kvfabric.server.peers`, the socket transport) the daemon is a TLS client
too: :attr:`ReloadingTLS.client_context` presents the same certificate as the client
certificate and checks the peer's against the client CA (the CA of every node's
certificate; without one, the system's trust store) and the host the peer advertises. It is
rebuilt with the server context on every reload, and read once per new connection.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading

from kvfabric.config import SecurityConfig
from kvfabric.errors import ConfigError

log = logging.getLogger(__name__)

_Stamp = tuple[tuple[int, int, int] | None, ...]


class ReloadingTLS:
    def __init__(self, security: SecurityConfig) -> None:
        assert security.tls_cert_file is not None
        self._cert = security.tls_cert_file
        self._key = security.tls_key_file
        self._client_ca = security.tls_client_ca_file
        self._lock = threading.Lock()
        self._stamp: _Stamp = ()
        self.reloads = 0
        try:
            self.context = self._build()  # the listeners'
            self._current = self.context
            self.client_context = self._build_client()
            self.reload()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"security.tls_*: cannot load the certificate: {exc}") from None
        self.context.sni_callback = self._select

    def _select(
        self, connection: ssl.SSLObject, _name: str | None, _context: ssl.SSLContext
    ) -> None:
        connection.context = self._current  # the newest certificate, for this handshake

    def _build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._cert, self._key)
        if self._client_ca is not None:  # both contexts: OpenSSL asks each at its step
            context.load_verify_locations(cafile=self._client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _build_client(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the chain and the name
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self._client_ca is not None:
            context.load_verify_locations(cafile=self._client_ca)
        else:
            context.load_default_certs()
        context.load_cert_chain(self._cert, self._key)  # our identity toward peers
        return context

    @property
    def mutual(self) -> bool:
        return self._client_ca is not None

    def reload(self) -> None:
        """Load the files into the live context (OSError / ssl.SSLError if they are bad)."""
        with self._lock:
            stamp = self._stamps()
            current, client = self._build(), self._build_client()  # both load, or neither
            self._current = current  # one assignment: a handshake sees old or new
            self.client_context = client
            self._stamp = stamp
            self.reloads += 1

    def reload_if_changed(self, *, force: bool = False) -> bool:
        """Reload when a file changed (or ``force``); True if a new certificate was loaded.
        Never raises: a bad file is logged and the old certificate keeps serving."""
        if not force and self._stamps() == self._stamp:
            return False
        try:
            self.reload()
        except (OSError, ssl.SSLError) as exc:
            log.error("TLS certificate reload failed, still serving the previous one: %s", exc)
            with self._lock:
                self._stamp = self._stamps()  # do not retry a bad file every period
            return False
        log.info("TLS certificate reloaded from %s", self._cert)
        return True

    def _stamps(self) -> _Stamp:
        out: list[tuple[int, int, int] | None] = []
        for path in (self._cert, self._key, self._client_ca):
            if path is None:
                continue
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)
