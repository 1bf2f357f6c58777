"""vLLM's KV event wire format, written without vLLM.

vLLM (``vllm/distributed/kv_events.py``) publishes ``KVEventBatch`` values encoded by msgspec's
msgpack encoder: the batch is an *array-like* struct ``[ts, events]`` (``data_parallel_rank``
omitted when unset), each event a *tagged* struct: a map whose ``type`` entry is the class
name, with every field that has no default and every defaulted field that is set. The daemon
must not import vLLM, so this module writes the same bytes with msgpack; the tests decode
them with vLLM's own msgspec types, which is the contract.

Frames on the PUB socket: ``(topic, seq as 8-byte big-endian, payload)``, as vLLM's
``ZmqEventPublisher`` sends them.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from kvfabric.kvevents.blocks import EngineBlocks

Event = dict[str, Any]


def block_stored(
    blocks: EngineBlocks,
    medium: str,
    lora_name: str | None,
    *,
    locality: str | None = None,
    ownership: str | None = None,
) -> Event:
    event: Event = {
        "type": "BlockStored",
        "block_hashes": list(blocks.hashes),
        "parent_block_hash": blocks.parent_hash,
        "token_ids": list(blocks.token_ids),
        "block_size": blocks.block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }
    if locality is not None:
        event["locality"] = locality
    if ownership is not None:
        event["ownership"] = ownership
    return event


def block_removed(
    hashes: list[int],
    medium: str,
    *,
    locality: str | None = None,
    ownership: str | None = None,
) -> Event:
    """A removal of blocks stored with an ``ownership`` names it again (consumers key such
    claims by ownership and medium)."""
    event: Event = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if locality is not None:
        event["locality"] = locality
    if ownership is not None:
        event["ownership"] = ownership
    return event


def all_blocks_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[Event], ts: float | None = None) -> bytes:
    """One ``KVEventBatch`` payload."""
    payload: bytes = msgpack.packb([time.time() if ts is None else ts, events], use_bin_type=True)
    return payload


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
