"""Chained chunk hashing: the keys of the prefix index.

Chunk *i* of a prompt in namespace *ns* has the key::

    h_i = xxh3_128(h_{i-1} || ns.seed || u32le(n_i) || int32le(tokens of chunk i))

with ``h_{-1}`` = 16 zero bytes and ``n_i`` the chunk's token count. The count makes a partial
last chunk (the prefill -> decode hand-off) a key of its own; only full chunks serve prefix
reuse. The hash depends on nothing process-local (no ``PYTHONHASHSEED``), so every process
and machine computes the same keys.

A whole prompt is hashed in one call: the token ids are converted to one little-endian int32
buffer once, and each chunk is a slice of it fed to a C hash (no per-token Python work). A
Python list or tuple is converted by the compiled ``kvfabric._tokens`` where the install
built it (about 10x numpy's conversion, which is otherwise most of the cost), else by numpy.
Hashing can resume from any chunk boundary (``parent=``), so a growing request re-hashes only
its new chunks.

A stored chunk may carry its own token ids (int32-LE bytes, :func:`token_bytes`); the store
takes them only once :func:`verify_chunk_tokens` found that they hash to the chunk's key.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvfabric.errors import SpecError, TokenMismatchError
from kvfabric.spec import Namespace

KEY_BYTES = 16
ROOT = bytes(KEY_BYTES)
_INT32 = np.dtype("<i4")
_U32 = struct.Struct("<I")
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _native(name: str) -> Callable[..., Any] | None:
    try:  # optional C extension (setup.py)
        module = importlib.import_module("kvfabric._tokens")
    except ImportError:
        return None
    return getattr(module, name, None)


# read at call time, so tests can set them to None to run the Python paths:
# pack_int32(list | tuple) -> int32-LE bytes
pack_int32: Callable[[list[int] | tuple[int, ...]], bytes] | None = _native("pack_int32")
# join_keys(list | tuple of bytes, size) -> bytes (kvfabric.protocol.messages.pack_keys)
join_keys: Callable[[Sequence[bytes], int], bytes] | None = _native("join_keys")


class ChunkRef(NamedTuple):
    """One chunk of a prompt: its key, its parent's key, and how many tokens it holds."""

    key: bytes
    parent: bytes
    num_tokens: int

    @property
    def is_root(self) -> bool:
        return self.parent == ROOT


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no copy when already one)."""
    if not isinstance(tokens, np.ndarray):
        try:
            if pack_int32 is not None and isinstance(tokens, (list, tuple)):
                return np.frombuffer(pack_int32(tokens), dtype=_INT32)  # read-only
            if not len(tokens):
                return np.empty(0, dtype=_INT32)
            tokens = np.array(tokens)  # then checked as any array: no silent float cast
        except (OverflowError, ValueError, TypeError, RuntimeError) as exc:
            raise SpecError(f"token ids must be int32 integers: {exc}") from None
    if tokens.ndim != 1:
        raise SpecError(f"token ids must be 1-D, got shape {tokens.shape}")
    if tokens.dtype == _INT32 and tokens.flags.c_contiguous:
        return tokens
    if tokens.dtype.kind not in "iu":
        raise SpecError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < _I32_MIN or tokens.max() > _I32_MAX):
        raise SpecError("token ids must fit in int32")
    return np.ascontiguousarray(tokens, dtype=_INT32)


# a chunk's own token ids as callers may give them (see :func:`token_bytes`)
ChunkTokens = bytes | Sequence[int] | np.ndarray


def token_bytes(tokens: ChunkTokens) -> bytes:
    """Token ids as int32-LE bytes, the form a chunk's tokens are sent and stored in (bytes
    are taken to be in that form already: :func:`verify_chunk_tokens` checks their length)."""
    if isinstance(tokens, bytes):
        return tokens
    return as_token_array(tokens).tobytes()


def verify_chunk_tokens(
    namespace: Namespace, key: bytes, parent: bytes, num_tokens: int, tokens: bytes
) -> None:
    """Raise TokenMismatchError unless ``tokens`` (int32-LE) are the ``num_tokens`` token ids
    of the chunk ``key`` whose parent is ``parent``: the key is recomputed from them."""
    if len(tokens) != num_tokens * 4:
        raise TokenMismatchError(
            f"tokens of chunk {key.hex()} must be {num_tokens} int32-LE ids "
            f"({num_tokens * 4} bytes), got {len(tokens)} bytes"
        )
    if chunk_keys(namespace, np.frombuffer(tokens, dtype=_INT32), parent=parent) != [key]:
        raise TokenMismatchError(
            f"tokens given with chunk {key.hex()} do not hash to its key "
            f"(with parent {parent.hex()} in its namespace)"
        )


def chunk_keys(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    *,
    parent: bytes = ROOT,
    include_partial: bool = True,
) -> list[bytes]:
    """Keys of every chunk of ``tokens`` (a prompt, or its continuation after ``parent``).

    ``include_partial=False`` drops a trailing chunk shorter than ``chunk_tokens`` (prefix
    lookups only ever match full chunks). This is the hot path: one C hash call per chunk.
    """
    if len(parent) != KEY_BYTES:
        raise SpecError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    arr = as_token_array(tokens)
    step = namespace.spec.chunk_tokens
    raw = arr.data.cast("B")
    seed = namespace.seed
    digest = xxhash.xxh3_128_digest
    full_header = seed + _U32.pack(step)
    stride = step * 4
    full_chunks = arr.shape[0] // step
    keys: list[bytes] = []
    append = keys.append
    prev = parent
    for start in range(0, full_chunks * stride, stride):
        prev = digest(prev + full_header + raw[start : start + stride])
        append(prev)
    tail = arr.shape[0] - full_chunks * step
    if tail and include_partial:
        append(digest(prev + seed + _U32.pack(tail) + raw[full_chunks * stride :]))
    return keys


def chunk_hashes(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    *,
    parent: bytes = ROOT,
    include_partial: bool = True,
) -> list[ChunkRef]:
    """Like :func:`chunk_keys`, with each chunk's parent and token count."""
    arr = as_token_array(tokens)
    keys = chunk_keys(namespace, arr, parent=parent, include_partial=include_partial)
    step = namespace.spec.chunk_tokens
    parents = [parent, *keys[:-1]]
    counts = [min(step, arr.shape[0] - i * step) for i in range(len(keys))]
    return [ChunkRef(k, p, n) for k, p, n in zip(keys, parents, counts)]
