"""Large requests answered in slices (kvfabric.server.slices) give the one-go handlers'
answers and errors, and give the event loop back while they run.

A real TieredStore and Session; the one-go handler (kvfabric.server.handlers) is the oracle.
Regression for every test here: on the old code the module did not exist, and a large
request held the loop from start to end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvfabric.config import AuthConfig
from kvfabric.errors import ForbiddenError, KVFabricError, ProtocolError
from kvfabric.hashing import chunk_hashes, chunk_keys
from kvfabric.protocol.messages import MAX_KEYS, Op, encode_namespace
from kvfabric.server import handlers, slices
from kvfabric.server.handlers import Context
from kvfabric.server.session import Session
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, chunk_tokens=16)
NS = Namespace("sliced", SPEC, tenant_salt="acme")
PROMPT = np.arange(40 * SPEC.chunk_tokens, dtype=np.int32)
STORED = 40


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Context]:
    tiers = (TierConfig(TierKind.DRAM, 1 << 20, page_size=4096),)  # room for every chunk
    store = TieredStore(
        StoreConfig(data_dir=str(tmp_path_factory.mktemp("store")), tiers=tiers), maintenance=False
    )
    for ref in chunk_hashes(NS, PROMPT):
        store.put(
            NS,
            ref.key,
            np.zeros(SPEC.chunk_bytes, np.uint8),
            parent=ref.parent,
            num_tokens=ref.num_tokens,
        )
    yield Context(store, AuthConfig(), "node", 16)
    store.close()


def session(tenant: str | None = None) -> Session:
    s = Session(local=True, max_leases=16)
    s.authenticate(tenant, "test")
    return s


def one_go(ctx: Context, op: Op, args: dict[str, Any]) -> Any:
    try:
        return handlers.HANDLERS[op].fn(ctx, session(), args)
    except KVFabricError as exc:
        return type(exc)


def sliced(ctx: Context, op: Op, args: dict[str, Any], s: Session | None = None) -> Any:
    assert slices.is_large(op, args)
    try:
        return asyncio.run(slices.answer(ctx, s or session(), op, args))
    except KVFabricError as exc:
        return type(exc)


def big_keys(n: int) -> list[bytes]:
    rng = np.random.default_rng(n)
    keys = [rng.bytes(16) for _ in range(n)]
    chain = chunk_keys(NS, PROMPT)
    for i in range(0, min(n, 30000), 997):  # stored keys scattered through the request
        keys[i] = chain[i % STORED]
    return keys


@pytest.mark.parametrize("n", [slices.LARGE_CONTAINS + 1, 5000, MAX_KEYS])
@pytest.mark.parametrize("packed", [False, True])
def test_contains_in_slices_is_the_one_go_answer(ctx: Context, n: int, packed: bool) -> None:
    keys = big_keys(n)
    args = {"ns": encode_namespace(NS), "keys": b"".join(keys) if packed else keys}
    answer = sliced(ctx, Op.CONTAINS, args)
    assert answer == one_go(ctx, Op.CONTAINS, args)
    assert sum(answer) == len(range(0, min(n, 30000), 997))


@pytest.mark.parametrize("n", [slices.LARGE_LOOKUP_KEYS + 1, MAX_KEYS])
@pytest.mark.parametrize("packed", [False, True])
def test_lookup_of_keys_in_slices_is_the_one_go_answer(ctx: Context, n: int, packed: bool) -> None:
    extra = np.arange(10**6, 10**6 + (n - STORED) * SPEC.chunk_tokens, dtype=np.int32)
    keys = chunk_keys(NS, np.concatenate([PROMPT, extra]))
    assert len(keys) == n
    args = {"ns": encode_namespace(NS), "keys": b"".join(keys) if packed else keys}
    answer = sliced(ctx, Op.LOOKUP, args)
    assert answer == one_go(ctx, Op.LOOKUP, args)
    assert answer["chunks"] == STORED


@pytest.mark.parametrize(
    "extra", [0, 1, 15, 16 * slices.HASH_SLICE, 16 * slices.HASH_SLICE + 7, (1 << 22) - len(PROMPT)]
)
def test_lookup_of_tokens_in_slices_is_the_one_go_answer(ctx: Context, extra: int) -> None:
    """Hashed a slice at a time as a continuation of the chain: the same keys, whatever the
    length (partial last chunk, a slice boundary, the protocol's maximum)."""
    tokens = np.concatenate(
        [PROMPT, np.arange(7, 7 + slices.LARGE_LOOKUP_TOKENS + extra, dtype=np.int32)]
    )[: 1 << 22]
    args = {"ns": encode_namespace(NS), "tokens": tokens.astype("<i4").tobytes()}
    answer = sliced(ctx, Op.LOOKUP, args)
    assert answer == one_go(ctx, Op.LOOKUP, args)
    assert answer["chunks"] == STORED
    assert answer["requested_chunks"] == len(tokens) // SPEC.chunk_tokens


@pytest.mark.parametrize(
    "op, args",
    [
        (Op.CONTAINS, {"keys": [b"\x00" * 16] * 5000 + [b"short"]}),  # bad key in the last slice
        (Op.CONTAINS, {"keys": [b"\x00" * 16] * (MAX_KEYS + 1)}),
        (Op.CONTAINS, {"keys": b"\x00" * (16 * 5000 + 3)}),
        (Op.CONTAINS, {"keys": b"\x00" * (16 * (MAX_KEYS + 1))}),
        (Op.LOOKUP, {"keys": [b"\x00" * 16] * 9000 + [None]}),
        (Op.LOOKUP, {"tokens": b"\x00" * (4 * (1 << 22) + 4)}),
        (Op.LOOKUP, {"tokens": b"\x00" * (4 * 70000 + 1)}),
    ],
)
def test_bad_large_requests_get_the_one_go_error(
    ctx: Context, op: Op, args: dict[str, Any]
) -> None:
    args = {"ns": encode_namespace(NS), **args}
    assert sliced(ctx, op, args) is ProtocolError
    assert one_go(ctx, op, args) is ProtocolError


def test_another_tenants_namespace_is_refused_before_any_slice(ctx: Context) -> None:
    args = {"ns": encode_namespace(NS), "keys": big_keys(5000)}
    assert sliced(ctx, Op.CONTAINS, args, session("globex")) is ForbiddenError


def test_small_malformed_and_cluster_requests_are_not_sliced() -> None:
    ns = encode_namespace(NS)
    assert not slices.is_large(Op.CONTAINS, {"ns": ns, "keys": [b"\x00" * 16] * 10})
    assert not slices.is_large(Op.CONTAINS, {"ns": ns, "keys": 12345})
    assert not slices.is_large(
        Op.LOOKUP, {"ns": ns, "scope": "cluster", "tokens": b"\x00" * (4 << 20)}
    )
    assert not slices.is_large(Op.PING, {})


def test_a_sliced_request_gives_the_loop_back_every_few_milliseconds(ctx: Context) -> None:
    """A ticker task on the same loop keeps running while the largest contains is answered:
    between two of its ticks the loop's thread never computes for much longer than the
    slice budget (CPU time, so that a preempted test process does not count)."""
    args = {"ns": encode_namespace(NS), "keys": big_keys(MAX_KEYS)}

    async def run() -> tuple[list[bool], float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.thread_time()
            while not done.is_set():
                await asyncio.sleep(0)
                now = time.thread_time()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        answer = await slices.answer(ctx, session(), Op.CONTAINS, args)
        done.set()
        await tick
        return answer, max(gaps)

    answer, longest = asyncio.run(run())
    assert len(answer) == MAX_KEYS
    assert longest < 0.010, f"the loop was held for {longest * 1e3:.1f} ms of CPU at once"
