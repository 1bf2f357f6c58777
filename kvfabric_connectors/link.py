"""An engine plugin's link to its node daemon: one the engine can live without.

A KV cache is an optimisation: when the daemon is missing, restarting or broken, the engine
must keep serving by recomputing. :class:`DaemonLink` connects lazily, and after a
connection-level failure (a call past its deadline included: a frozen daemon) stays away
for ``retry_after_s``, so an absent daemon costs each request nothing but its hit. A call
that ran into its deadline cost its caller that long, so after one the wait doubles for
each that follows the retry at once (up to ``MAX_RETRY_AFTER_S``): a frozen daemon's
retries become rare. While it stays away, :meth:`DaemonLink.client` raises
:class:`LinkDownError` at once; reporting that one through :meth:`failed` changes nothing.
A daemon that refuses the engine's token (none given, or a wrong one) is treated the same
way, with a log line that says so: it will not take the token on the next request either.
``engine`` names the engine in the daemon's traffic metrics.

Threads: a :class:`~kvfabric.client.Client` serialises requests on one connection. By
default every thread shares the link's one client (the vLLM connector gives each blocking
activity a link of its own instead). With ``per_thread=True`` each calling thread gets its
own client, and so its own leases (a batch pins, copies and releases on the thread that
called): for engines that call from several threads at once (SGLang's prefetch, hit-query
and backup threads). Either way the link is thread-safe, and "the daemon is down" is one
state shared by all its threads.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace

from kvfabric.client import Client
from kvfabric.errors import AuthError, UnavailableError

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0


class LinkDownError(UnavailableError):
    """The link stays away from its daemon for now (no connection was attempted)."""


class DaemonLink:
    def __init__(
        self,
        socket_path: str,
        token: str | None,
        *,
        timeout: float,
        engine: str,
        retry_after_s: float = 2.0,
        per_thread: bool = False,
    ) -> None:
        self.socket_path = socket_path
        self.engine = engine
        self.per_thread = per_thread
        self.failures = 0
        self._token = token
        self._timeout = timeout
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()  # the down state and the list of clients
        # shared: threads wait while one of them connects the client they will all use
        self._connecting: AbstractContextManager[object] = (
            nullcontext() if per_thread else threading.Lock()
        )
        # where the caller's (generation, client) lives: per thread, or one for all
        self._slot = threading.local() if per_thread else SimpleNamespace()
        self._clients: list[Client] = []  # every open client, to close them all
        self._generation = 0  # bumped by close(): clients of older ones are not used again
        self._down_until = 0.0
        self._down = False
        self._streak = 0  # failures in a row, each soon after the retry of the one before
        self._streak_until = 0.0

    def client(self) -> Client:
        """The caller's connected client; UnavailableError at once while the daemon is
        considered down."""
        with self._connecting:
            client = self._mine()
            if client is not None:
                return client
            with self._lock:
                generation = self._generation
                if time.monotonic() < self._down_until:
                    raise LinkDownError(f"kvfabric daemon at {self.socket_path} is unavailable")
            try:
                # reconnect within the call's own deadline only: the engine must not stall
                client = Client(
                    self.socket_path,
                    token=self._token,
                    timeout=self._timeout,
                    reconnect_timeout=1.0,
                    engine=self.engine,
                )
            except (OSError, UnavailableError, AuthError) as exc:
                with self._lock:
                    self._mark_down(exc)
                raise UnavailableError(f"kvfabric daemon at {self.socket_path}: {exc}") from exc
            with self._lock:
                closed_meanwhile = generation != self._generation
                if not closed_meanwhile:
                    self._clients.append(client)
                    if self._down:
                        log.warning("kvfabric daemon at %s is back", self.socket_path)
                        self._down = False
            if closed_meanwhile:
                client.close()
                raise UnavailableError(f"the link to {self.socket_path} was closed")
            self._slot.client = (generation, client)
            return client

    def failed(self, exc: BaseException) -> None:
        """Report a failed call: a connection-level failure drops the caller's client."""
        if not isinstance(exc, (OSError, UnavailableError)) or isinstance(exc, LinkDownError):
            return
        client = self._mine()
        self._slot.client = None
        with self._lock:
            self._mark_down(exc)
            if client in self._clients:
                self._clients.remove(client)
        if client is not None:
            client.close()

    def _mine(self) -> Client | None:
        mine: tuple[int, Client] | None = getattr(self._slot, "client", None)
        if mine is None or mine[0] != self._generation:
            return None
        return mine[1]

    @property
    def down(self) -> bool:
        """Whether the link stays away from its daemon now."""
        return time.monotonic() < self._down_until

    def _mark_down(self, exc: BaseException) -> None:
        """Under the lock."""
        self.failures += 1
        now = time.monotonic()
        # only a call that ran into its deadline (a frozen daemon) cost the caller time: an
        # absent daemon refuses at once, so it is retried as often as ever
        waited = isinstance(exc, TimeoutError)
        self._streak = self._streak + 1 if waited and now <= self._streak_until else 0
        window = min(self._retry_after_s * 2**self._streak, MAX_RETRY_AFTER_S)
        self._down_until = now + window
        self._streak_until = self._down_until + max(window, 1.0)
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
        """Close every client; a later call on any thread connects again."""
        with self._lock:
            clients, self._clients = self._clients, []
            self._generation += 1
        for client in clients:
            client.close()


def held_prefix(held: list[bool]) -> int:
    """How many leading chunks a ``contains`` answer says the daemon holds."""
    count = 0
    for here in held:
        if not here:
            break
        count += 1
    return count
