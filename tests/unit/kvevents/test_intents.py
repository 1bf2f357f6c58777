"""Announced writes (the ``intend`` op's table), on a fake clock: a prompt's chunks are on
the node's change log from the moment its engine admits it, withdrawn only when they were
never written, and never announced twice."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.errors import TokenMismatchError
from kvfabric.hashing import chunk_hashes
from kvfabric.kvevents.intents import IntendedChunk, Intents
from kvfabric.kvevents.log import ChangeLog
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
NS = Namespace("intents", SPEC)
TTL = 30.0


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def chunks(first: int, count: int) -> list[IntendedChunk]:
    tokens = list(range(first, first + count * SPEC.chunk_tokens))
    out, start = [], 0
    for ref in chunk_hashes(NS, tokens):
        ids = np.asarray(tokens[start : start + ref.num_tokens], dtype="<i4").tobytes()
        out.append(IntendedChunk(ref.key, ref.parent, ref.num_tokens, ids))
        start += ref.num_tokens
    return out


@pytest.fixture
def setup():
    log, held, clock = ChangeLog(), set(), Clock()
    intents = Intents(log, lambda ns, key: key in held, "dram", ttl_s=TTL, capacity=8, clock=clock)
    return intents, log, held, clock


def changes(log: ChangeLog) -> list[tuple[bool, bytes]]:
    return [(c.stored, c.key) for c in log.read(0, 1000).changes]


def test_an_admitted_prompt_is_announced_at_once_with_its_tokens(setup) -> None:
    intents, log, _, _ = setup
    wanted = chunks(0, 3)
    assert intents.announce(NS, wanted) == 3
    read = log.read(0, 100).changes
    assert [(c.stored, c.key, c.tier) for c in read] == [(True, c.key, "dram") for c in wanted]
    assert [c.tokens for c in read] == [c.tokens for c in wanted]
    assert intents.announce(NS, wanted) == 0  # announced already: not twice
    assert len(changes(log)) == 3


def test_chunks_the_store_holds_are_not_announced(setup) -> None:
    intents, log, held, _ = setup
    wanted = chunks(0, 2)
    held.add(wanted[0].key)
    assert intents.announce(NS, wanted) == 1
    assert changes(log) == [(True, wanted[1].key)]


def test_an_intent_never_written_is_withdrawn_after_its_ttl(setup) -> None:
    intents, log, _, clock = setup
    wanted = chunks(0, 2)
    intents.announce(NS, wanted)
    clock.now += TTL - 1
    assert intents.expire() == 0 and len(intents) == 2
    clock.now += 2
    assert intents.expire() == 2 and len(intents) == 0
    assert changes(log)[2:] == [(False, c.key) for c in wanted]


def test_an_intent_that_was_written_ends_silently(setup) -> None:
    intents, log, held, clock = setup
    wanted = chunks(0, 2)
    intents.announce(NS, wanted)
    held.add(wanted[0].key)  # reserved by the engine meanwhile: the store speaks for it
    clock.now += TTL + 1
    assert intents.expire() == 1
    assert changes(log)[2:] == [(False, wanted[1].key)]


def test_past_capacity_intents_are_refused_not_evicting_older_ones(setup) -> None:
    intents, _, _, _ = setup
    assert intents.announce(NS, chunks(0, 6)) == 6
    assert intents.announce(NS, chunks(10_000, 4)) == 2
    assert intents.refused == 2 and len(intents) == 8


def test_tokens_that_are_not_the_chunks_own_announce_nothing(setup) -> None:
    """Negative control: a client cannot make the node announce blocks of another prompt."""
    intents, log, _, _ = setup
    good, bad = chunks(0, 1)[0], chunks(500, 1)[0]
    forged = IntendedChunk(good.key, good.parent, good.num_tokens, bad.tokens)
    with pytest.raises(TokenMismatchError):
        intents.announce(NS, [good, forged])
    assert changes(log) == [] and len(intents) == 0
