"""What a control request moved, read off its result, for the per-engine traffic metrics:
lookup tokens asked for and found, payload bytes pinned for reading and reserved for
writing, chunks pinned for other nodes' pullers. Only the ops that move KV count; the
result shapes are the handlers' replies. The same reading feeds the recent-transfers ring
(:mod:`kvfabric.api.transfers`): :meth:`Traffic.transfer` says which entry, if any."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfabric.api.transfers import TransferKind
from kvfabric.protocol.messages import Op


@dataclass(frozen=True)
class Traffic:
    lookup_tokens: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    # per conversion kind a read asked for ("dtype", "heads", "layout"): chunks converted
    conversions: tuple[tuple[str, int], ...] = ()
    served_chunks: int = 0  # pinned here for another node's puller (peer_pin)
    served_tokens: int = 0
    chunks: int = 0  # chunks a read pinned or a write reserved (no metric: the transfers ring)

    def metric_counts(self) -> dict[str, Any]:
        """The keyword arguments of ``Metrics.count_engine_traffic``."""
        counts = dict(vars(self))
        del counts["chunks"]
        return counts

    def transfer(self) -> tuple[TransferKind, int, int | None, int | None] | None:
        """(kind, chunks, bytes, tokens) of the transfer this request made; None: none."""
        if self.bytes_read:
            return "get", self.chunks, self.bytes_read, None
        if self.bytes_written:
            return "put", self.chunks, self.bytes_written, None
        if self.served_chunks:
            return "serve", self.served_chunks, None, self.served_tokens
        return None


def traffic_of(op: Op, result: Any) -> Traffic | None:
    if op is Op.LOOKUP:  # peer_tokens: a cluster-scope hit past the local prefix
        return Traffic(
            lookup_tokens=int(result.get("requested_tokens", 0)),
            hit_tokens=int(result["tokens"]) + int(result.get("peer_tokens", 0)),
        )
    if op is Op.PEER_PIN:
        pinned = [item["result"] for item in result if item.get("ok")]
        return Traffic(
            served_chunks=len(pinned), served_tokens=sum(int(p["num_tokens"]) for p in pinned)
        )
    if op is Op.GET:
        return Traffic(
            bytes_read=int(result["nbytes"]), conversions=_conversions([result]), chunks=1
        )
    if op is Op.GET_BATCH:
        pinned = [item["result"] for item in result if item.get("ok")]
        return Traffic(
            bytes_read=_batch_bytes(result), conversions=_conversions(pinned), chunks=len(pinned)
        )
    if op is Op.RESERVE:
        return Traffic(bytes_written=int(result["nbytes"]), chunks=1)
    if op is Op.RESERVE_BATCH:
        return Traffic(
            bytes_written=_batch_bytes(result), chunks=sum(1 for i in result if i.get("ok"))
        )
    return None


def _conversions(pinned: list[dict[str, Any]]) -> tuple[tuple[str, int], ...]:
    counts: dict[str, int] = {}
    for reply in pinned:
        for kind in reply.get("conversions", ()):
            counts[kind] = counts.get(kind, 0) + 1
    return tuple(sorted(counts.items()))


def _batch_bytes(items: list[dict[str, Any]]) -> int:
    return sum(int(item["result"]["nbytes"]) for item in items if item.get("ok"))
