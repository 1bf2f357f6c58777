"""A raw control session that sends requests without waiting for replies (the daemon answers
each by its request id), for tests of the daemon's side of concurrency on one connection.

The client library's :class:`~kvfabric.client.Client` sends one request at a time; a test
that needs requests in flight together (pings on a fixed schedule while the daemon is busy,
pipelined requests over TLS) uses this instead. It connects and says hello with the
library's own :func:`~kvfabric.client.connection.open_session` and maps no arena (the
descriptors a Unix-socket hello passes are closed). Single-threaded: one caller sends and
receives.
"""

from __future__ import annotations

import itertools
import os
import select
import ssl
import time
from typing import Any

from kvfabric.client.connection import Address, open_session, result_of
from kvfabric.client.tls import TLSOption
from kvfabric.errors import UnavailableError
from kvfabric.protocol.frames import encode_frame
from kvfabric.protocol.messages import Op, request


class PipelinedSession:
    def __init__(
        self,
        address: Address,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        tls: TLSOption = None,
    ) -> None:
        self._sock, self._decoder, self.hello, fds = open_session(
            address, token, time.monotonic() + timeout, tls=tls
        )
        for fd in fds:
            os.close(fd)
        self._ids = itertools.count(1)

    def send(self, op: Op, args: dict[str, Any] | None = None) -> int:
        """Send one request; its id (its reply carries it)."""
        request_id = next(self._ids)
        self._sock.settimeout(None)
        self._sock.sendall(encode_frame(request(request_id, op, args or {})))
        return request_id

    def receive(self, wait: float) -> list[tuple[int, Any]]:
        """The replies that arrive within ``wait`` seconds (none: an empty list), as
        (request id, result); an error reply raises its typed error. A read that ends inside
        a frame (a loaded host splits replies) keeps reading until a whole one is there or
        the wait is over."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            buffered = isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()
            left = max(0.0, deadline - time.monotonic())
            if not buffered and not select.select([self._sock], [], [], left)[0]:
                return []
            data = self._sock.recv(1 << 16)
            if not data:
                raise UnavailableError("the daemon closed the connection")
            replies = [(int(m["id"]), result_of(m)) for m in self._decoder.feed(data)]
            if replies or time.monotonic() >= deadline:
                return replies

    def call_all(
        self, requests: list[tuple[Op, dict[str, Any]]], timeout: float = 30.0
    ) -> list[Any]:
        """Send every request, then collect their replies (in request order)."""
        ids = [self.send(op, args) for op, args in requests]
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(ids):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(ids) - len(replies)} replies missing after {timeout} s")
            replies.update(self.receive(left))
        return [replies[i] for i in ids]

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> PipelinedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
