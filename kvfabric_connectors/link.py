"""An engine plugin's link to its node daemon: one the engine can live without.

A KV cache is an optimisation: when the daemon is missing, restarting or broken, the engine
must keep serving by recomputing. :class:`DaemonLink` connects lazily, and after a
connection-level failure stays away for ``retry_after_s`` so an absent daemon costs each
request nothing but its hit. A daemon that refuses the engine's token (none given, or a
wrong one) is treated the same way, with a log line that says so: it will not take the
token on the next request either. ``engine`` names the engine in the daemon's traffic
metrics.
Thread-safe (requests share one connection; give a blocking caller a link of its own).
"""

from __future__ import annotations

import logging
import threading
import time

from kvfabric.client import Client
from kvfabric.errors import AuthError, UnavailableError

log = logging.getLogger(__name__)


class DaemonLink:
    def __init__(
        self,
        socket_path: str,
        token: str | None,
        *,
        timeout: float,
        engine: str,
        retry_after_s: float = 2.0,
    ) -> None:
        self.socket_path = socket_path
        self.engine = engine
        self.failures = 0
        self._token = token
        self._timeout = timeout
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._down_until = 0.0
        self._down = False

    def client(self) -> Client:
        """The connected client; UnavailableError at once while the daemon is considered
        down."""
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                raise UnavailableError(f"kvfabric daemon at {self.socket_path} is unavailable")
            try:
                # reconnect within the call's own deadline only: the engine must not stall
                self._client = Client(
                    self.socket_path,
                    token=self._token,
                    timeout=self._timeout,
                    reconnect_timeout=1.0,
                    engine=self.engine,
                )
            except (OSError, UnavailableError, AuthError) as exc:
                self._mark_down(exc)
                raise UnavailableError(f"kvfabric daemon at {self.socket_path}: {exc}") from exc
            if self._down:
                log.warning("kvfabric daemon at %s is back", self.socket_path)
                self._down = False
            return self._client

    def failed(self, exc: BaseException) -> None:
        """Report a failed call: a connection-level failure drops the client."""
        if isinstance(exc, (OSError, UnavailableError)):
            with self._lock:
                client, self._client = self._client, None
                self._mark_down(exc)
            if client is not None:
                client.close()

    def _mark_down(self, exc: BaseException) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self._retry_after_s
        if not self._down:
            if isinstance(exc, AuthError):
                log.warning(
                    "kvfabric daemon at %s refused %s's token (%s): give the connector "
                    "the daemon's token (its 'token' setting or $KVFABRIC_TOKEN); %s "
                    "goes on without the fabric",
                    self.socket_path,
                    self.engine,
                    exc,
                    self.engine,
                )
            else:
                log.warning(
                    "kvfabric daemon at %s unavailable (%s); %s goes on without it",
                    self.socket_path,
                    exc,
                    self.engine,
                )
            self._down = True

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def held_prefix(held: list[bool]) -> int:
    """How many leading chunks a ``contains`` answer says the daemon holds."""
    count = 0
    for here in held:
        if not here:
            break
        count += 1
    return count
