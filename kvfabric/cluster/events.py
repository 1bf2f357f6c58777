"""KV event codec: :class:`KVEvent` <-> flat byte fields of a Redis stream entry.

Fields (all byte strings, no pickle): ``kind`` (stored|removed), ``seed`` (namespace seed hex),
``keys`` (the 16-byte chunk keys concatenated), ``parent`` (16 bytes), ``tokens`` (the run's
token count, decimal), ``tier``, ``node``, ``epoch``. A stored run whose node published its
token ids adds ``token_ids`` (every chunk's int32-LE token ids, concatenated in key order),
``token_counts`` (each chunk's token count, u32-LE), ``chunk_tokens`` (decimal) and ``lora``
(UTF-8); entries without them (removals, older writers, namespaces whose token ids a node
does not publish) decode with ``token_ids`` None.

Cost: the token ids live in the stream only (the index's entries never hold them), 4 bytes
per token plus 4 per chunk in every stored entry: about 1 KiB per 256-token chunk, for as
long as the stream keeps the entry (``max_events`` entries, each a run of chunks), so a
stream of ``N`` retained chunks holds about ``N * (4 * chunk_tokens + 4)`` bytes of them.

Decoding validates lengths and kinds and raises :class:`~kvfabric.errors.ProtocolError` on a
malformed entry.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import cast

from kvfabric.cluster.index import (
    MAX_LORA_BYTES,
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
_COUNT = struct.Struct("<I")


def stored_event(run: Sequence[ChunkRecord], node_id: str, epoch: int) -> KVEvent:
    """The event of one chain run (see :func:`~kvfabric.cluster.index.chain_runs`)."""
    first = run[0]
    tokens = [r.tokens for r in run]
    return KVEvent(
        "stored",
        tuple(r.key for r in run),
        first.tier,
        node_id,
        epoch,
        first.seed.hex(),
        first.parent,
        sum(r.num_tokens for r in run),
        token_ids=None if None in tokens else cast(tuple[bytes, ...], tuple(tokens)),
        chunk_tokens=first.chunk_tokens,
        lora_id=first.lora_id,
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
    fields = {
        b"kind": event.kind.encode(),
        b"seed": event.seed_hex.encode(),
        b"keys": b"".join(event.keys),
        b"parent": event.parent,
        b"tokens": str(event.num_tokens).encode(),
        b"tier": event.tier.encode(),
        b"node": event.node_id.encode(),
        b"epoch": str(event.epoch).encode(),
    }
    if event.token_ids is not None:
        fields[b"token_ids"] = b"".join(event.token_ids)
        fields[b"token_counts"] = b"".join(_COUNT.pack(len(t) // 4) for t in event.token_ids)
        fields[b"chunk_tokens"] = str(event.chunk_tokens).encode()
        fields[b"lora"] = event.lora_id.encode()
    return fields


def _token_ids(
    stream_id: str, fields: Mapping[bytes, bytes], keys: int, num_tokens: int
) -> tuple[tuple[bytes, ...], int, str]:
    """(each chunk's token ids, chunk_tokens, lora) of a stored entry that has them."""
    raw, counts = fields[b"token_ids"], fields[b"token_counts"]
    chunk_tokens = int(fields[b"chunk_tokens"])
    lora = fields[b"lora"].decode()
    if len(counts) != keys * _COUNT.size or len(fields[b"lora"]) > MAX_LORA_BYTES:
        raise ProtocolError(f"event {stream_id}: malformed token ids")
    sizes = [n for (n,) in _COUNT.iter_unpack(counts)]
    if (
        not 0 < chunk_tokens < 1 << 32
        or not all(0 < n <= chunk_tokens for n in sizes)
        or sum(sizes) != num_tokens
        or len(raw) != 4 * num_tokens
    ):
        raise ProtocolError(f"event {stream_id}: token ids do not match the run")
    out, start = [], 0
    for n in sizes:
        out.append(raw[start : start + 4 * n])
        start += 4 * n
    return tuple(out), chunk_tokens, lora


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
        num_tokens = int(fields[b"tokens"])
        tokens: tuple[tuple[bytes, ...] | None, int, str] = (None, 0, "")
        if b"token_ids" in fields:
            if kind != "stored":
                raise ProtocolError(f"event {stream_id}: token ids in a removal")
            tokens = _token_ids(stream_id, fields, len(keys), num_tokens)
        return KVEvent(
            cast(EventKind, kind),  # checked above
            keys,
            fields[b"tier"].decode(),
            fields[b"node"].decode(),
            int(fields[b"epoch"]),
            fields[b"seed"].decode(),
            parent,
            num_tokens,
            stream_id,
            *tokens,
        )
    except (KeyError, ValueError, UnicodeDecodeError, struct.error) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"event {stream_id}: malformed entry ({exc!r})") from None
