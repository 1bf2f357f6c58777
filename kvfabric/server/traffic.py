"""What a control request moved, read off its result, for the per-engine traffic metrics:
lookup tokens asked for and found, payload bytes pinned for reading and reserved for
writing. Only the ops that move KV count; the result shapes are the handlers' replies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfabric.protocol.messages import Op


@dataclass(frozen=True)
class Traffic:
    lookup_tokens: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


def traffic_of(op: Op, result: Any) -> Traffic | None:
    if op is Op.LOOKUP:
        return Traffic(lookup_tokens=int(result.get("requested_tokens", 0)),
                       hit_tokens=int(result["tokens"]))
    if op is Op.GET:
        return Traffic(bytes_read=int(result["nbytes"]))
    if op is Op.GET_BATCH:
        return Traffic(bytes_read=_batch_bytes(result))
    if op is Op.RESERVE:
        return Traffic(bytes_written=int(result["nbytes"]))
    if op is Op.RESERVE_BATCH:
        return Traffic(bytes_written=_batch_bytes(result))
    return None


def _batch_bytes(items: list[dict[str, Any]]) -> int:
    return sum(int(item["result"]["nbytes"]) for item in items if item.get("ok"))
