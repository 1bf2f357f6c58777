"""The backend's link to its node daemon: one it can live without, one client per thread.

A KV cache is an optimisation: when the daemon is missing, restarting or broken, SGLang must
keep serving by recomputing. :class:`DaemonLink` connects lazily, and after a failure stays
away for ``retry_after_s`` so an absent daemon costs each storage call nothing but its miss.
SGLang calls a storage backend from several threads at once (the prefetch, hit-query and
backup threads); a :class:`~kvfabric.client.Client` serialises requests on one connection,
so each thread gets its own client (and its own leases: a batch pins, copies and releases on
the thread that called). Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time

from kvfabric.client import Client
from kvfabric.errors import UnavailableError

log = logging.getLogger(__name__)


class DaemonLink:
    def __init__(
        self, socket_path: str, token: str | None, *, timeout: float, retry_after_s: float = 2.0
    ) -> None:
        self.socket_path = socket_path
        self._token = token
        self._timeout = timeout
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._local = threading.local()
        self._clients: list[Client] = []  # every thread's, to close them all
        self._generation = 0  # bumped by close(): threads drop clients of older ones
        self._down_until = 0.0
        self._down = False

    def client(self) -> Client:
        """This thread's connected client; UnavailableError at once while the daemon is
        considered down."""
        client = self._mine()
        if client is not None:
            return client
        with self._lock:
            generation = self._generation
            if time.monotonic() < self._down_until:
                raise UnavailableError(f"kvfabric daemon at {self.socket_path} is unavailable")
        try:
            # reconnect within the call's own deadline only: SGLang's threads must not stall
            client = Client(
                self.socket_path,
                token=self._token,
                timeout=self._timeout,
                reconnect_timeout=1.0,
                engine="sglang",
            )
        except (OSError, UnavailableError) as exc:
            with self._lock:
                self._mark_down(exc)
            raise UnavailableError(f"kvfabric daemon at {self.socket_path}: {exc}") from exc
        with self._lock:
            self._clients.append(client)
            if self._down:
                log.warning("kvfabric daemon at %s is back", self.socket_path)
                self._down = False
        self._local.client = (generation, client)
        return client

    def failed(self, exc: BaseException) -> None:
        """Report a failed call on this thread: a connection-level failure drops its client."""
        if not isinstance(exc, (OSError, UnavailableError)):
            return
        client = self._mine()
        self._local.client = None
        with self._lock:
            self._mark_down(exc)
            if client in self._clients:
                self._clients.remove(client)
        if client is not None:
            client.close()

    def _mine(self) -> Client | None:
        mine = getattr(self._local, "client", None)
        if mine is None or mine[0] != self._generation:
            return None
        return mine[1]

    def _mark_down(self, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self._retry_after_s
        if not self._down:
            log.warning(
                "kvfabric daemon at %s unavailable (%s); HiCache storage misses until it is back",
                self.socket_path,
                exc,
            )
            self._down = True

    def close(self) -> None:
        """Close every thread's client; a later call on any thread connects again."""
        with self._lock:
            clients, self._clients = self._clients, []
            self._generation += 1
        for client in clients:
            client.close()
