"""Smoke test of the real-vLLM tooling: two fresh in-process engines, no connector."""

from __future__ import annotations

import random


def _prompt(seed: int, length: int = 80) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(length)]


def test_two_engines_greedy_and_local_prefix_cache(run_engines) -> None:
    a, b = _prompt(1), _prompt(2)
    # block 32: an 80-token prompt has two full blocks the local prefix cache can reuse
    engine = {"block_size": 32, "max_model_len": 512, "prompts": [a, b, a], "max_tokens": 8}
    result = run_engines(
        {
            "multiprocessing": False,
            "engines": [dict(engine, name="first"), dict(engine, name="second")],
        }
    )

    first, second = result["engines"]
    assert [e["name"] for e in result["engines"]] == ["first", "second"]
    for run in (first, second):
        outputs = run["outputs"]
        assert [len(o["token_ids"]) for o in outputs] == [8, 8, 8]
        assert outputs[0]["token_ids"] != outputs[1]["token_ids"]  # the model is not constant
        assert outputs[0]["num_cached_tokens"] == 0
        assert outputs[2]["num_cached_tokens"] == 64  # local prefix cache: 2 blocks of 32
        assert outputs[2]["token_ids"] == outputs[0]["token_ids"]
        assert all(o["prefill_s"] is not None and o["prefill_s"] > 0 for o in outputs)
    # fresh engines, same weights, greedy: identical outputs
    assert [o["token_ids"] for o in first["outputs"]] == [o["token_ids"] for o in second["outputs"]]
