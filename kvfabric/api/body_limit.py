"""ASGI middleware that refuses request bodies over a size limit with 413, before the
application parses them: by ``Content-Length`` up front; a body without one (chunked) is read
here, at most the limit, and refused as soon as it passes it. Independent of the web
framework's version."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        if declared is None:  # streamed: take it in here, bounded, and hand it on whole
            body = await self._read_bounded(receive)
            if body is None:
                await self._refuse(send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _read_bounded(self, receive: Receive) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)  # the client left: the app sees an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "kind": "too_large",
                    "message": f"request body over {self.max_bytes} bytes "
                    "(limits.http_max_body_bytes)",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # after the body: wait for the disconnect as usual
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
