"""The answer to a prefix lookup, shared by the store, the protocol and the clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LookupResult:
    """Longest stored prefix of a chain: how many chunks / tokens, and in which tiers."""

    requested_chunks: int
    matched_chunks: int
    matched_tokens: int
    tier_tokens: dict[str, int] = field(default_factory=dict)  # matched tokens per tier name
    requested_tokens: int = 0  # matched + unmatched tokens (full chunks unless told otherwise)
    # cluster scope only: the longest prefix (chunks) any live node holds, and whether the
    # global index may lag (unreachable, or updates still queued)
    cluster_chunks: int | None = None
    stale: bool = False
    # daemon side only (not on the wire): of the tokens past the local prefix, those another
    # node holds, counted as hits from "peer" (see TieredStore.lookup's peer_chunks)
    peer_tokens: int = 0

    @property
    def miss_tokens(self) -> int:
        return self.requested_tokens - self.matched_tokens - self.peer_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested_chunks": self.requested_chunks,
            "chunks": self.matched_chunks,
            "tokens": self.matched_tokens,
            "tier_tokens": dict(self.tier_tokens),
            "requested_tokens": self.requested_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LookupResult:
        nodes = data.get("nodes")
        return cls(
            int(data["requested_chunks"]),
            int(data["chunks"]),
            int(data["tokens"]),
            {str(k): int(v) for k, v in data["tier_tokens"].items()},
            int(data.get("requested_tokens", 0)),
            None if nodes is None else max((int(n["chunks"]) for n in nodes), default=0),
            bool(data.get("stale", False)),
        )
