"""A stored chunk as an engine's KV blocks: what vLLM's ``BlockStored`` / ``BlockRemoved`` say.

A router that consumes vLLM KV events (vllm-router's ``kv_aware``, llm-d's indexer) thinks in
the engine's blocks of ``block_size`` tokens, each with a hash, chained through its parent.
kvfabric stores chunks of ``chunk_tokens`` tokens; a chunk is ``chunk_tokens / block_size``
consecutive blocks. This module maps one onto the other, with no state:

- Block ``j`` of the chunk with key ``K`` has the hash ``u64(xxh3_64(K || u32le(j)))``:
  deterministic on every node and process, so a copy of a chunk on another node (a pull, a
  push) announces the same blocks, and a removal names exactly what a store named.
- The first block's parent is the parent chunk's last block (a full chunk: block
  ``chunk_tokens / block_size - 1`` of the parent key); the chain's first chunk has none.
- Only whole blocks are announced: a partial last chunk (the prefill -> decode hand-off)
  contributes ``num_tokens // block_size`` blocks, as vLLM announces only full blocks.

Consumers that re-hash token ids themselves (the routers do, with their own hash) use the
token ids; the block hashes only have to be stable ids for removals and parents. Mapping
needs ``chunk_tokens % block_size == 0``: :func:`blocks_per_chunk` refuses anything else,
and a namespace whose chunks do not split into whole blocks is not announced.

Engine-side code (the vLLM connector) uses this module as well as the daemon, so it stands
on nothing but the hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from kvfabric.hashing import ROOT

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class EngineBlocks:
    """One chunk as engine blocks: ``hashes`` in order, the first block's ``parent_hash``
    (None at a chain's root), and the ``token_ids`` of every block, concatenated."""

    hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


def blocks_per_chunk(chunk_tokens: int, block_size: int) -> int:
    """How many engine blocks one full chunk holds; ``ValueError`` unless they divide."""
    if block_size < 1 or chunk_tokens % block_size:
        raise ValueError(
            f"chunk_tokens {chunk_tokens} is not a multiple of the block size {block_size}"
        )
    return chunk_tokens // block_size


def block_hash(key: bytes, index: int) -> int:
    """The hash of block ``index`` of the chunk ``key`` (an unsigned 64-bit int)."""
    return xxhash.xxh3_64_intdigest(key + index.to_bytes(4, "little")) & _U64


def chunk_block_hashes(key: bytes, num_tokens: int, block_size: int) -> tuple[int, ...]:
    """The hashes of the whole blocks of a chunk of ``num_tokens`` tokens."""
    return tuple(block_hash(key, j) for j in range(num_tokens // block_size))


def engine_blocks(
    key: bytes,
    parent: bytes,
    tokens: bytes,
    chunk_tokens: int,
    block_size: int,
) -> EngineBlocks | None:
    """The engine blocks of one chunk whose own token ids are ``tokens`` (int32-LE); None
    when it holds no whole block."""
    per_chunk = blocks_per_chunk(chunk_tokens, block_size)
    ids = np.frombuffer(tokens, dtype="<i4")
    whole = len(ids) // block_size
    if whole == 0:
        return None
    parent_hash = None if parent == ROOT else block_hash(parent, per_chunk - 1)
    return EngineBlocks(
        hashes=tuple(block_hash(key, j) for j in range(whole)),
        parent_hash=parent_hash,
        token_ids=tuple(ids[: whole * block_size].tolist()),
        block_size=block_size,
    )
