"""What an engine's server-sent event stream carried: its output tokens and its usage.

The gateway passes a stream through byte for byte and tallies it on the side: events are
cut at blank lines however the bytes were chunked; an event whose JSON has choices is one
output step (vLLM sends one token per event; ``finish_reason`` rides on the last one), the
usage event (``stream_options.include_usage``, ``choices: []``) is not, and ``[DONE]`` ends
it. Usage, when the client asked for it, is the engine's own count and wins.
"""

from __future__ import annotations

import json
from typing import Any

_DATA = b"data:"


class StreamTally:
    def __init__(self) -> None:
        self._pending = b""
        self.tokens = 0  # output steps seen
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        self._pending += chunk
        while True:
            end = self._pending.find(b"\n\n")
            if end < 0:
                return
            event, self._pending = self._pending[:end], self._pending[end + 2 :]
            self._event(event)

    def output_tokens(self) -> int:
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        return self.tokens

    def _event(self, event: bytes) -> None:
        data = b"".join(
            line[len(_DATA) :].strip() for line in event.split(b"\n") if line.startswith(_DATA)
        )
        if not data or data == b"[DONE]":
            return
        try:
            body = json.loads(data)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        if body.get("choices"):
            self.tokens += 1
        usage = body.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
