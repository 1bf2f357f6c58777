"""KV event codec: :class:`KVEvent` <-> flat byte fields of a Redis stream entry.

Fields (all byte strings, no pickle): ``kind`` (stored|removed), ``seed`` (namespace seed hex),
``keys`` (the 16-byte chunk keys concatenated), ``parent`` (16 bytes), ``tokens``, ``tier``,
``node``, ``epoch``. Decoding validates lengths and kinds and raises
:class:`~kvfabric.errors.ProtocolError` on a malformed entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from kvfabric.cluster.index import (
    ChunkRecord,
    EventKind,
    KVEvent,
    Update,
    chain_runs,
    removal_groups,
)
from kvfabric.errors import ProtocolError
from kvfabric.hashing import KEY_BYTES

MAX_EVENT_KEYS = 1 << 16


def stored_event(run: Sequence[ChunkRecord], node_id: str, epoch: int) -> KVEvent:
    """The event of one chain run (see :func:`~kvfabric.cluster.index.chain_runs`)."""
    first = run[0]
    return KVEvent(
        "stored",
        tuple(r.key for r in run),
        first.tier,
        node_id,
        epoch,
        first.seed.hex(),
        first.parent,
        sum(r.num_tokens for r in run),
    )


def removed_event(group: Sequence[ChunkRecord], node_id: str, epoch: int) -> KVEvent:
    first = group[0]
    return KVEvent(
        "removed", tuple(r.key for r in group), first.tier, node_id, epoch, first.seed.hex()
    )


def batch_events(batch: Sequence[Update], node_id: str, epoch: int) -> list[KVEvent]:
    """Events of one batch, in order: consecutive updates of one kind grouped into runs."""
    out: list[KVEvent] = []
    i = 0
    while i < len(batch):
        kind = batch[i][0]
        j = i
        while j < len(batch) and batch[j][0] == kind:
            j += 1
        records = [rec for _, rec in batch[i:j]]
        if kind == "stored":
            out += [stored_event(run, node_id, epoch) for run in chain_runs(records)]
        else:
            out += [removed_event(g, node_id, epoch) for g in removal_groups(records)]
        i = j
    return out


def encode(event: KVEvent) -> dict[bytes, bytes]:
    return {
        b"kind": event.kind.encode(),
        b"seed": event.seed_hex.encode(),
        b"keys": b"".join(event.keys),
        b"parent": event.parent,
        b"tokens": str(event.num_tokens).encode(),
        b"tier": event.tier.encode(),
        b"node": event.node_id.encode(),
        b"epoch": str(event.epoch).encode(),
    }


def decode(stream_id: str, fields: Mapping[bytes, bytes]) -> KVEvent:
    try:
        kind = fields[b"kind"].decode()
        raw = fields[b"keys"]
        parent = fields[b"parent"]
        if kind not in ("stored", "removed"):
            raise ProtocolError(f"event {stream_id}: unknown kind {kind!r}")
        if (
            len(raw) % KEY_BYTES
            or len(raw) > MAX_EVENT_KEYS * KEY_BYTES
            or len(parent) != KEY_BYTES
        ):
            raise ProtocolError(f"event {stream_id}: malformed keys")
        keys = tuple(raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES))
        return KVEvent(
            cast(EventKind, kind),  # checked above
            keys,
            fields[b"tier"].decode(),
            fields[b"node"].decode(),
            int(fields[b"epoch"]),
            fields[b"seed"].decode(),
            parent,
            int(fields[b"tokens"]),
            stream_id,
        )
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"event {stream_id}: malformed entry ({exc!r})") from None
