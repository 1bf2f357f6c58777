"""A bf16 prefill feeds an fp32 decode engine: the consumer's connector reads the fabric's
bf16 KV (``kv_dtype: bfloat16``) and converts it into its fp32 cache at the edge.

Criterion: the first 3 greedy tokens of every prompt equal the fp32 engine's own monolithic
run. The loaded KV differs from what fp32 would compute by bf16 rounding (relative ~2^-9), so
later tokens of a long greedy run on a random-weight model may drift apart at a near-tie;
measured here, the first 5 tokens agree on all four prompts. A wrong layout or a missing
conversion does not come close (the negative control of test_vllm_connector.py shows what
wrong KV does to the very first token)."""

from __future__ import annotations

import random

from engine_jobs import kvfabric_connector

CHECKED_TOKENS = 3
PROMPT_LEN = 700


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(PROMPT_LEN)]


def test_bf16_producer_feeds_an_fp32_consumer(start_daemon, job_runner, tmp_path) -> None:
    daemon = start_daemon("store.tiers.dram.capacity=256MiB")
    prompts = [prompt(seed) for seed in (21, 22, 23, 24)]
    result = job_runner(
        tmp_path,
        {
            "engines": [
                {"name": "fp32", "dtype": "float32", "prompts": prompts, "max_tokens": 8},
                {
                    "name": "bf16-prefill",
                    "kv_transfer_config": kvfabric_connector(
                        role="kv_producer", socket=daemon.socket
                    ),
                    "prompts": prompts,
                    "max_tokens": 1,
                },
                {
                    "name": "fp32-decode",
                    "dtype": "float32",
                    "prompts": prompts,
                    "max_tokens": 8,
                    "kv_transfer_config": kvfabric_connector(
                        role="kv_consumer", socket=daemon.socket, kv_dtype="bfloat16"
                    ),
                },
            ]
        },
    )
    engines = {e["name"]: e["outputs"] for e in result["engines"]}
    for own, decoded in zip(engines["fp32"], engines["fp32-decode"]):
        assert decoded["num_cached_tokens"] == PROMPT_LEN - 1  # the bf16 KV was found
        assert decoded["token_ids"][:CHECKED_TOKENS] == own["token_ids"][:CHECKED_TOKENS]
