"""Large legal requests, answered in slices on the event loop.

A ``contains`` of 65,536 keys or a lookup of millions of token ids is legal, but answered in
one go it holds the event loop, and so every other session, for hundreds of milliseconds.
:func:`is_large` picks those requests out; :func:`answer` computes them on the loop a slice
at a time and gives the loop back (``await asyncio.sleep(0)``) whenever it has held it for
:data:`SLICE_S`, so other sessions' requests are served between slices.

Answers are the one-go handlers' (:mod:`kvfabric.server.handlers`): ``contains`` asks the
store key by key either way; a lookup validates and hashes its keys in slices, then asks the
store once, so it still sees one consistent prefix and counts as one lookup. Validation is
the same (:mod:`kvfabric.protocol.messages`), the whole request's size first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvfabric.hashing import KEY_BYTES, ROOT, chunk_keys
from kvfabric.protocol.messages import (
    MAX_KEYS,
    Op,
    arg_chain_tokens,
    arg_keys,
    arg_tokens,
)
from kvfabric.server.handlers import Context
from kvfabric.server.session import Session

SLICE_S = 0.002  # the longest a sliced request holds the loop between two yields
CONTAINS_SLICE = 128  # keys asked between two looks at the clock (~1 ms)
KEYS_SLICE = 4096  # keys validated per slice (~0.3 ms)
HASH_SLICE = 1024  # chunks hashed per slice (~0.5 ms)
LARGE_CONTAINS = 256  # a contains of more keys is answered in slices
LARGE_LOOKUP_KEYS = 8192  # a lookup of more keys, or
LARGE_LOOKUP_TOKENS = 1 << 16  # of more token ids, is answered in slices


class Pacer:
    """Yields to the event loop once the caller has held it for ``budget`` seconds."""

    def __init__(self, budget: float = SLICE_S) -> None:
        self._budget = budget
        self._since = time.perf_counter()

    async def __call__(self) -> None:
        if time.perf_counter() - self._since >= self._budget:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


def is_large(op: Op, args: dict[str, Any]) -> bool:
    """Whether the request is answered in slices (a malformed one never is: the one-go
    handler refuses it at once)."""
    if op is Op.CONTAINS:
        return _key_count(args.get("keys")) > LARGE_CONTAINS
    if op is Op.LOOKUP and args.get("scope", "local") == "local":
        if "keys" in args:
            return _key_count(args.get("keys")) > LARGE_LOOKUP_KEYS
        tokens = args.get("tokens")
        return isinstance(tokens, bytes) and len(tokens) > 4 * LARGE_LOOKUP_TOKENS
    return False


async def answer(
    ctx: Context, session: Session, op: Op, args: dict[str, Any]
) -> list[bool] | dict[str, Any]:
    """The answer to a request :func:`is_large` picked, computed in slices."""
    pace = Pacer()
    if op is Op.CONTAINS:
        return await _contains(ctx, session, args, pace)
    return await _lookup(ctx, session, args, pace)


async def _contains(
    ctx: Context, session: Session, args: dict[str, Any], pace: Pacer
) -> list[bool]:
    ns = session.namespace(args.get("ns"))
    out: list[bool] = []
    for keys in _key_slices(args):
        for start in range(0, len(keys), CONTAINS_SLICE):
            out.extend(
                [ctx.store.contains(ns, key) for key in keys[start : start + CONTAINS_SLICE]]
            )
            await pace()
    return out


async def _lookup(
    ctx: Context, session: Session, args: dict[str, Any], pace: Pacer
) -> dict[str, Any]:
    ns = session.namespace(args.get("ns"))
    keys: list[bytes] = []
    num_tokens = None
    if "keys" in args:
        for part in _key_slices(args):
            keys.extend(part)
            await pace()
        num_tokens = arg_chain_tokens(args, len(keys), ns.spec.chunk_tokens)
    else:
        tokens = np.frombuffer(arg_tokens(args), dtype="<i4")
        step = ns.spec.chunk_tokens
        span = HASH_SLICE * step
        parent = ROOT
        for start in range(0, len(tokens) // step * step, span):
            part = chunk_keys(
                ns, tokens[start : start + span], parent=parent, include_partial=False
            )  # a continuation of the chain so far
            keys.extend(part)
            parent = part[-1]
            await pace()
    return ctx.store.lookup(ns, keys, num_tokens=num_tokens).to_dict()


def _key_count(value: Any) -> int:
    if isinstance(value, bytes):
        return len(value) // KEY_BYTES
    return len(value) if isinstance(value, list) else 0


def _key_slices(args: dict[str, Any]) -> Iterator[list[bytes]]:
    """``args["keys"]`` validated a slice at a time, after the whole request's size."""
    value = args.get("keys")
    if (
        isinstance(value, bytes) and (len(value) % KEY_BYTES or len(value) > MAX_KEYS * KEY_BYTES)
    ) or (isinstance(value, list) and len(value) > MAX_KEYS):
        arg_keys(args)  # raises the one-go handler's error
    if not isinstance(value, (bytes, list)):
        arg_keys(args)  # raises the one-go handler's error for a missing or odd value
        return
    width = KEY_BYTES if isinstance(value, bytes) else 1
    for start in range(0, _key_count(value), KEYS_SLICE):
        yield arg_keys({"keys": value[start * width : (start + KEYS_SLICE) * width]})
