"""The HTTP plane's server: uvicorn on a thread and event loop of its own, with deadlines.

Contract:

* :class:`HttpServer` serves an ASGI app on an already-bound listener, on its own thread and
  loop, so request parsing and validation never run on the control plane's loop (a stalled
  HTTP request cannot delay a control round trip, beyond the GIL).
* A request's headers and body must arrive within ``request_timeout_s`` of its first byte
  (or of the connection, for its first request); otherwise the connection is closed (with a
  408 when no response has started). h11 has no such deadline of its own: slowloris clients
  (a partial header, a byte at a time) would hold their sockets forever.
  :class:`DeadlineH11Protocol` adds it.
* An idle keep-alive connection is closed after ``keepalive_s``; past ``max_connections``
  open connections a new request is answered 503 (uvicorn's ``limit_concurrency``).
* One source address holds at most ``max_connections_per_ip`` of them (loopback included):
  a connection over that bound is answered 503 (``unavailable``, ``connection: close``) at
  its first request and counts toward neither bound, so a flood from one address cannot
  take the global slots from every other client. A silent one is closed at its read
  deadline like any other. Each refusal calls ``on_refused("per_ip_limit")`` (on the HTTP
  loop) and is summed up in one warning line at most every :data:`LOG_EVERY_S` seconds.
* ``ssl_context`` (a :class:`kvfabric.server.tls.ReloadingTLS` context) serves HTTPS only;
  the context is used as is, so a certificate reloaded into it applies to new connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

_TIMEOUT_BODY = b'{"error": {"kind": "deadline", "message": "request not received in time"}}'
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)
_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class HttpLimits:
    request_timeout_s: float = 10.0
    keepalive_s: float = 5.0
    max_connections: int = 1024
    max_connections_per_ip: int = 64
    shutdown_grace_s: float = 5.0


class _PerIpGate:
    """Admitted connections per source address, and the ones refused over the bound.

    One per server, shared by its connections; used on the HTTP loop only (no locks).
    """

    def __init__(self, limit: int, on_refused: Callable[[str], None] | None) -> None:
        self.limit = limit
        self.open: Counter[str] = Counter()
        self.refused: set[DeadlineH11Protocol] = set()  # closed by the server's shutdown
        self._on_refused = on_refused
        self._unlogged = 0
        self._last_log = 0.0
        body = json.dumps(
            {
                "error": {
                    "kind": "unavailable",
                    "message": (
                        f"more than {limit} open HTTP connections from this address "
                        "(limits.http_max_connections_per_ip)"
                    ),
                }
            }
        ).encode()
        self._headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self._body = body

    def admit(self, ip: str) -> bool:
        if self.open[ip] >= self.limit:
            return False
        self.open[ip] += 1
        return True

    def release(self, ip: str) -> None:
        self.open[ip] -= 1
        if self.open[ip] <= 0:
            del self.open[ip]

    def count_refusal(self, ip: str) -> None:
        if self._on_refused is not None:
            self._on_refused("per_ip_limit")
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            log.warning(
                "HTTP connections refused over limits.http_max_connections_per_ip=%d "
                "(since the last such line): %d; the last from %s",
                self.limit,
                self._unlogged,
                ip,
            )
            self._unlogged = 0
            self._last_log = now

    async def refusal(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app a refused connection's request gets instead of the daemon's."""
        await send({"type": "http.response.start", "status": 503, "headers": self._headers})
        await send({"type": "http.response.body", "body": self._body})


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a read deadline per request (see the module docstring)."""

    request_timeout_s = 10.0  # set per server by :func:`_protocol_class`, with gate
    gate: _PerIpGate

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_deadline: asyncio.TimerHandle | None = None
        self._admitted_ip: str | None = None
        super().connection_made(transport)
        ip = self.client[0] if self.client else None
        if ip is not None and self.gate.admit(ip):
            self._admitted_ip = ip
        elif ip is not None:
            self.app = self.gate.refusal  # its first request is answered 503, then closed
            self.connections.discard(self)  # uvicorn's set is what max_connections counts
            self.gate.refused.add(self)
            self.gate.count_refusal(ip)
        self._arm()  # a connection that never sends a byte is a slowloris too

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self.conn.their_state not in _RECEIVED:
            self._arm()  # the first bytes of the next request on a keep-alive connection
        super().data_received(data)
        self._disarm_if_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_if_received()  # a pipelined request may have been read whole

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._admitted_ip is not None:
            self.gate.release(self._admitted_ip)
            self._admitted_ip = None
        self.gate.refused.discard(self)
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _disarm_if_received(self) -> None:
        if self.conn.their_state in _RECEIVED:
            self._disarm()

    def _expired(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state in _RECEIVED:
            return
        if (
            self.conn.their_state is h11.IDLE
            and not self.conn.trailing_data[0]
            and self.cycle is not None
        ):
            return  # between requests: the keep-alive timer is in charge
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_TIMEOUT_RESPONSE)
        if self.cycle is not None:
            self.cycle.disconnected = True  # the app's receive() returns http.disconnect
            self.cycle.message_event.set()
        self.transport.close()


def _protocol_class(request_timeout_s: float, gate: _PerIpGate) -> type[DeadlineH11Protocol]:
    return type(
        "DeadlineH11Protocol",
        (DeadlineH11Protocol,),
        {"request_timeout_s": request_timeout_s, "gate": gate},
    )


class _ThreadedUvicorn(uvicorn.Server):
    """uvicorn on a thread of its own: the daemon, not uvicorn, owns the signals."""

    def __init__(self, config: uvicorn.Config, gate: _PerIpGate) -> None:
        super().__init__(config)
        self._gate = gate

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: Any = None) -> None:
        for refused in list(self._gate.refused):  # outside uvicorn's set: it would miss them
            refused.transport.close()
        await super().shutdown(sockets)


class HttpServer:
    """``start()`` serves ``app`` on ``listener`` until ``stop()``; ``on_refused(reason)``
    is called on the HTTP loop for each connection refused over a per-address bound."""

    def __init__(
        self,
        app: Any,
        listener: Any,
        limits: HttpLimits,
        *,
        ssl_context: ssl.SSLContext | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        factory = None if ssl_context is None else (lambda _config, _default: ssl_context)
        gate = _PerIpGate(limits.max_connections_per_ip, on_refused)
        config = uvicorn.Config(
            app,
            log_level="warning",
            log_config=None,  # its lines go through the daemon's handler: text or JSON alike
            access_log=False,
            lifespan="off",
            http=_protocol_class(limits.request_timeout_s, gate),
            timeout_keep_alive=limits.keepalive_s,  # type: ignore[arg-type]  # uvicorn takes a float
            limit_concurrency=limits.max_connections,
            timeout_graceful_shutdown=max(1, round(limits.shutdown_grace_s)),
            ssl_context_factory=factory,
        )
        self._server = _ThreadedUvicorn(config, gate)
        self._listener = listener
        self._loop_factory = loop_factory or asyncio.new_event_loop
        self._thread = threading.Thread(target=self._run, name="kvfabric-http", daemon=True)
        self.error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> None:
        """Start serving; returns once uvicorn is up (raises what stopped it otherwise)."""
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the HTTP server did not start: {self.error!r}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop accepting, let requests finish (up to the grace period), join the thread."""
        self._server.should_exit = True
        self._thread.join()

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                runner.run(self._server.serve(sockets=[self._listener]))
        except BaseException as exc:
            self.error = exc
            log.exception("the HTTP server stopped")
