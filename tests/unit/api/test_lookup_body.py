"""/v1/lookup bodies parsed in pieces (kvfabric.api.lookup_body): the same result as
json.loads for valid JSON, every malformed body refused, and no long hold of the GIL."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from kvfabric.api import lookup_body
from kvfabric.api.app import LookupRequest
from kvfabric.api.lookup_body import BodyInvalid, BodyTooLarge, parse_lookup

NS = {"model": "m", "spec": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}}


@pytest.mark.parametrize(
    "text",
    [
        "{}",
        '{"a": 1}',
        ' {"token_ids": [1, 2 ,3], "x": {"y": [1,2]}} ',
        '{"token_ids": []}',
        '{"token_ids": [ ]}',
        "[1,2]",
        '"s"',
        '{"chunk_hashes": ["ab", "cd"], "scope": "local"}',
        '{"token_ids": [1], "token_ids": [2]}',
        '{"token_ids": "x"}',
        '{"token_ids": null}',
    ],
)
def test_valid_json_parses_as_json_loads_does(text: str) -> None:
    assert lookup_body._loads(text) == json.loads(text)


def test_long_lists_cut_into_pieces_parse_as_json_loads_does() -> None:
    rng = random.Random(3)
    ids = [rng.randint(-(1 << 31), (1 << 31) - 1) for _ in range(300_000)]
    hashes = [f"{rng.getrandbits(256):064x}" for _ in range(20_000)]
    for separators in ((",", ":"), (" , ", " : "), (",\n  ", ":\t")):
        text = json.dumps(
            {"namespace": NS, "token_ids": ids, "chunk_hashes": hashes}, separators=separators
        )
        assert lookup_body._loads(text) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        '{"token_ids": [1,2,]}',
        '{"token_ids": [,]}',
        '{"token_ids": [1 2]}',
        '{"a": 1,}',
        '{"a" 1}',
        '{"a": 1} x',
        '{"token_ids": [1, "]", 2]}',
        "{",
        '{"token_ids": [1',
        '{"token_ids": [[1,2]]}',
        "",
    ],
)
def test_malformed_bodies_are_refused(text: str) -> None:
    with pytest.raises((ValueError, IndexError)):
        lookup_body._loads(text)


def test_a_small_field_may_not_be_huge() -> None:
    with pytest.raises(ValueError, match="delimiter|over"):
        lookup_body._loads('{"namespace": ' + json.dumps(list(range(100_000))) + "}")


def test_parsing_a_15_mb_body_never_holds_the_gil_long() -> None:
    """Regression: on the old code one json.loads of this body held the GIL ~0.3 s, then
    pydantic built a million errors (13 s), all on the event loop the control plane shared."""
    body = json.dumps({"namespace": NS, "token_ids": [1 << 40] * 1_000_000}).encode()
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        with pytest.raises(BodyInvalid) as info:
            parse_lookup(body, LookupRequest, max_tokens=1 << 20, max_hashes=1 << 16, hash_chars=64)
    finally:
        stop.set()
        ticker.join()
    assert info.value.total == 1_000_000 and len(info.value.issues) == 10
    assert max(gaps) < 0.1, max(gaps)  # ~20 ms here; 0.3 s with one json.loads


def test_counts_are_checked_before_items() -> None:
    body = json.dumps({"namespace": NS, "token_ids": ["x"] * 11}).encode()
    with pytest.raises(BodyTooLarge, match="at most 10"):
        parse_lookup(body, LookupRequest, max_tokens=10, max_hashes=1, hash_chars=64)
    body = json.dumps({"namespace": NS, "chunk_hashes": ["x"] * 2}).encode()
    with pytest.raises(BodyInvalid) as info:
        parse_lookup(body, LookupRequest, max_tokens=10, max_hashes=1, hash_chars=64)
    assert info.value.issues[0]["type"] == "too_long"


def test_a_valid_body_keeps_its_lists() -> None:
    body = json.dumps({"namespace": NS, "token_ids": list(range(100))}).encode()
    parsed = parse_lookup(body, LookupRequest, max_tokens=100, max_hashes=1, hash_chars=64)
    assert parsed.token_ids == list(range(100)) and parsed.chunk_hashes is None
    assert parsed.namespace.value.model_id == "m"
