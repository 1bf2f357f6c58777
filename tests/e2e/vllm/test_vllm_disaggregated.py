"""Prefill -> decode across two nodes: a producer engine on node A computes the prompt
(``max_tokens=1``), a consumer engine on node B continues from the fabric's KV, by pull (B's
daemon fetches the chunks from A) and by push (A's daemon sends them to B as the layers are
computed). Two real daemons as separate processes and a real redis-server; greedy outputs of
the decode must equal a monolithic run, with only the last prompt token computed."""

from __future__ import annotations

import random

import pytest
from engine_jobs import kvfabric_connector

from kvfabric.client import Client

PROMPT_LEN = 700
TRANSPORTS = ["socket", "nixl"]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(PROMPT_LEN)]


def node(start_daemon, redis_url: str, name: str, transport: str):
    return start_daemon(
        "store.tiers.dram.capacity=256MiB",
        "store.tiers.ssd.capacity=1GiB",
        f"node_id={name}",
        "cluster.index=redis",
        f"cluster.redis_url={redis_url}",
        "cluster.heartbeat_s=0.2",
        "tcp.port=0",
        f"cluster.transport={transport}",
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_then_decode_by_pull(
    start_daemon, redis_server, job_runner, tmp_path, transport: str
) -> None:
    prefill = node(start_daemon, redis_server.url, "prefill-a", transport)
    decode = node(start_daemon, redis_server.url, "decode-b", transport)
    tokens = prompt(11)
    result = job_runner(
        tmp_path,
        {
            "engines": [
                {"name": "monolithic", "prompts": [tokens], "max_tokens": 8},
                {
                    "name": "prefill",
                    "kv_transfer_config": kvfabric_connector(
                        role="kv_producer", socket=prefill.socket
                    ),
                    "prompts": [tokens],
                    "max_tokens": 1,
                },
                {
                    "name": "decode",
                    "kv_transfer_config": kvfabric_connector(
                        role="kv_consumer", socket=decode.socket
                    ),
                    "prompts": [tokens],
                    "max_tokens": 8,
                    "kv_transfer_params_from": "prefill",
                },
            ]
        },
    )
    (monolithic,) = result.outputs("monolithic")
    (first,) = result.outputs("prefill")
    (decoded,) = result.outputs("decode")
    assert first["kv_transfer_params"] == {"kvfabric": {"tokens": PROMPT_LEN}}
    assert first["token_ids"] == monolithic["token_ids"][:1]
    assert decoded["token_ids"] == monolithic["token_ids"]
    assert decoded["num_cached_tokens"] == PROMPT_LEN - 1  # only the last token computed
    # the chunks were on the other node: pulled while the engine could run other requests
    decode_totals = next(e for e in result["engines"] if e["name"] == "decode")
    assert decode_totals["connector_totals"]["background_loads"] == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_then_decode_by_push(
    start_daemon, redis_server, job_runner, tmp_path, transport: str
) -> None:
    """The prefill node is gone before the decode starts: the KV can only have come by
    push (a producer's engine shuts down only once its pushes have ended)."""
    prefill = node(start_daemon, redis_server.url, "prefill-a", transport)
    decode = node(start_daemon, redis_server.url, "decode-b", transport)
    tokens = prompt(12)
    first = job_runner(
        tmp_path / "prefill",
        {
            "engines": [
                {"name": "monolithic", "prompts": [tokens], "max_tokens": 8},
                {
                    "name": "prefill",
                    "kv_transfer_config": kvfabric_connector(
                        role="kv_producer", socket=prefill.socket
                    ),
                    "prompts": [tokens],
                    "max_tokens": 1,
                    "kv_transfer_params": [{"kvfabric": {"push_to": "decode-b"}}],
                },
            ]
        },
    )
    prefill.kill()
    (monolithic,) = first.outputs("monolithic")
    (handoff,) = first.outputs("prefill")
    second = job_runner(
        tmp_path / "decode",
        {
            "engines": [
                {
                    "name": "decode",
                    "kv_transfer_config": kvfabric_connector(
                        role="kv_consumer", socket=decode.socket
                    ),
                    "prompts": [tokens],
                    "max_tokens": 8,
                    "kv_transfer_params": [handoff["kv_transfer_params"]],
                },
            ]
        },
    )
    (decoded,) = second.outputs("decode")
    assert decoded["token_ids"] == monolithic["token_ids"]
    assert decoded["num_cached_tokens"] == PROMPT_LEN - 1
    with Client(decode.socket) as client:
        assert client.stats()["objects"] == 3  # the prompt's chunks, partial one included
