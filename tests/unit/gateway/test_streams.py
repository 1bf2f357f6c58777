"""A stream's tally counts output steps and reads usage, however its bytes were chunked."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvfabric.gateway.streams import StreamTally


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


TOKENS = [{"choices": [{"text": f"t{i}", "finish_reason": None}]} for i in range(5)]
USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}


def test_one_step_per_event_with_choices_and_usage_is_not_a_step() -> None:
    plain = StreamTally()
    plain.feed(sse(*TOKENS, b"[DONE]"))
    assert (plain.tokens, plain.output_tokens(), plain.usage) == (5, 5, None)
    counted = StreamTally()
    counted.feed(sse(*TOKENS, USAGE, b"[DONE]"))
    assert counted.tokens == 5 and counted.usage == USAGE["usage"]


def test_usage_is_the_engine_s_own_count_when_it_sent_one() -> None:
    tally = StreamTally()
    tally.feed(sse(*TOKENS[:2], {"choices": [], "usage": {"completion_tokens": 9}}))
    assert tally.output_tokens() == 9


@given(st.lists(st.integers(min_value=1, max_value=40), max_size=30))
def test_chunk_boundaries_anywhere_give_the_same_tally(cuts: list[int]) -> None:
    raw = sse(*TOKENS, USAGE, b"[DONE]")
    tally, at = StreamTally(), 0
    for size in cuts:
        tally.feed(raw[at : at + size])
        at += size
    tally.feed(raw[at:])
    assert (tally.tokens, tally.output_tokens()) == (5, 5)


def test_an_error_event_or_garbage_is_no_step() -> None:
    tally = StreamTally()
    tally.feed(sse({"error": {"kind": "engine_failed"}}, b"not json", b"[1, 2]") + b": ping\n\n")
    assert tally.tokens == 0 and tally.output_tokens() == 0
