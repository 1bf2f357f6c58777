"""The token ids one OpenAI completion SSE event carries (``choices[].token_ids``), for tests
that read streams: how many events carried tokens says a stream was streamed."""

from __future__ import annotations

from typing import Any


def carried_token_ids(event: dict[str, Any]) -> list[int]:
    """Every choice's ``token_ids`` of one decoded ``data:`` event, in order (none: [])."""
    return [t for choice in event.get("choices") or () for t in choice.get("token_ids") or ()]
