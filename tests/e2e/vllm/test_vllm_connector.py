"""KVFabricConnector on a real vLLM (CPU) with a tiny random-weight Llama and real daemons.

Every claim is about greedy outputs: a run that loads KV from the fabric must produce exactly
the tokens of a run without the connector, and a run that loads corrupted KV must not.
Engines run in subprocesses (tests/e2e/vllm/engine_runner.py); several engines share a job
because building the first engine of a process dominates the cost.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from engine_jobs import kvfabric_connector
from transformers import AutoConfig

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import Namespace
from kvfabric_connectors.hf import namespace_for

CHUNK = 256
PROMPT_LEN = 700  # two full chunks and a partial one of 188 tokens
SHARED = 600  # P2 shares this many leading tokens with P1: two full chunks
SMALL = ["store.tiers.dram.capacity=256MiB", "store.tiers.ssd.capacity=1GiB"]


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


P1 = prompt(1)
P2 = P1[:SHARED] + prompt(2, PROMPT_LEN - SHARED)
P3 = prompt(3)
P4 = prompt(4)


def namespace(model: Path, tenant: str = "") -> Namespace:
    """The namespace the connector derives for the tiny model (served name = its path)."""
    return namespace_for(
        str(model), AutoConfig.from_pretrained(model), chunk_tokens=CHUNK, tenant_salt=tenant
    )


@pytest.fixture(scope="module")
def node(start_module_daemon):
    return start_module_daemon("vllm-node", *SMALL)


@pytest.fixture(scope="module")
def reuse_job(node, job_runner, tmp_path_factory) -> dict:
    """One job, fresh engines one after another against one daemon (see each test)."""
    both = kvfabric_connector(role="kv_both", socket=node.socket)
    return job_runner(
        tmp_path_factory.mktemp("reuse"),
        {
            "engines": [
                {"name": "plain", "prompts": [P1, P2, P3, P4]},
                {"name": "store", "kv_transfer_config": both, "prompts": [P1]},
                {
                    "name": "reuse",
                    "kv_transfer_config": both,
                    "prompts": [P1, P2],
                    "reset_prefix_cache_after": [0],
                },
                {
                    "name": "chunked-store",
                    "kv_transfer_config": both,
                    "prompts": [P3],
                    "max_num_batched_tokens": 128,
                },
                {
                    "name": "chunked-reuse",
                    "kv_transfer_config": both,
                    "prompts": [P3],
                    "max_num_batched_tokens": 128,
                },
                {
                    "name": "other-tenant",
                    "kv_transfer_config": both,
                    "prompts": [P1],
                    "cache_salt": "tenant-b",
                },
                {
                    "name": "no-daemon",
                    "kv_transfer_config": kvfabric_connector(
                        role="kv_both", socket=str(node.data_dir / "nobody-listens.sock")
                    ),
                    "prompts": [P1],
                },
            ]
        },
    )


def test_prefix_reuse_across_fresh_engines_gives_identical_outputs(
    reuse_job, node, tiny_model
) -> None:
    assert reuse_job.tokens("store") == reuse_job.tokens("plain")[:1]
    assert reuse_job.cached("store") == [0]
    assert reuse_job.totals("store")["saved_chunks"] == 3  # the partial last chunk too
    # a fresh engine: everything but the last prompt token comes from the fabric
    assert reuse_job.cached("reuse")[0] == PROMPT_LEN - 1
    assert reuse_job.tokens("reuse")[0] == reuse_job.tokens("plain")[0]
    with Client(node.socket) as client:
        keys = [r.key for r in chunk_hashes(namespace(tiny_model), P1)]
        assert client.lookup(namespace(tiny_model), keys=keys).matched_chunks == 3


def test_partial_prefix_hit_loads_exactly_the_shared_full_chunks(reuse_job) -> None:
    assert reuse_job.cached("reuse")[1] == (SHARED // CHUNK) * CHUNK
    assert reuse_job.tokens("reuse")[1] == reuse_job.tokens("plain")[1]


def test_chunked_prefill_saves_and_loads(reuse_job) -> None:
    assert reuse_job.cached("chunked-store") == [0]
    assert reuse_job.totals("chunked-store")["saved_chunks"] == 3
    assert reuse_job.cached("chunked-reuse") == [PROMPT_LEN - 1]
    assert (
        reuse_job.tokens("chunked-store")
        == reuse_job.tokens("chunked-reuse")
        == reuse_job.tokens("plain")[2:3]
    )


def test_another_tenant_gets_no_hit(reuse_job) -> None:
    assert reuse_job.cached("other-tenant") == [0]
    assert reuse_job.tokens("other-tenant") == reuse_job.tokens("plain")[:1]


def test_engine_serves_without_a_daemon(reuse_job) -> None:
    assert reuse_job.cached("no-daemon") == [0]
    assert reuse_job.tokens("no-daemon") == reuse_job.tokens("plain")[:1]


def test_negative_control_corrupted_kv_changes_the_output(
    reuse_job, node, tiny_model, job_runner, tmp_path
) -> None:
    ns = namespace(tiny_model)
    noise = torch.Generator().manual_seed(0)
    with Client(node.socket) as client:
        for ref in chunk_hashes(ns, P1)[:2]:
            assert client.delete(ns, ref.key)
            values = ns.spec.layout(ref.num_tokens).nbytes // 2
            payload = torch.randn(values, generator=noise).to(torch.bfloat16)  # plausible KV
            assert client.put(ns, ref.key, payload, parent=ref.parent, num_tokens=ref.num_tokens)
    result = job_runner(
        tmp_path,
        {
            "engines": [
                {
                    "name": "corrupt",
                    "kv_transfer_config": kvfabric_connector(role="kv_both", socket=node.socket),
                    "prompts": [P1],
                }
            ]
        },
    )
    assert result.cached("corrupt") == [PROMPT_LEN - 1]  # the noise was loaded
    assert result.tokens("corrupt") != reuse_job.tokens("plain")[:1]


def test_a_load_that_fails_is_recomputed(start_daemon, tiny_model, job_runner, tmp_path) -> None:
    """The fabric says it holds the prompt, but a chunk is unreadable when the worker loads
    it (its SSD record is damaged): vLLM recomputes those blocks, the output is unchanged."""
    daemon = start_daemon(*SMALL)
    both = kvfabric_connector(role="kv_both", socket=daemon.socket)
    first = job_runner(
        tmp_path / "store",
        {
            "engines": [
                {"name": "plain", "prompts": [P3]},
                {"name": "store", "kv_transfer_config": both, "prompts": [P3]},
            ]
        },
    )
    assert daemon.stop() == 0  # memory-resident chunks go to SSD on shutdown
    key = chunk_hashes(namespace(tiny_model), P3)[1].key
    damage_ssd_record(daemon.data_dir, key)
    daemon.start()
    result = job_runner(
        tmp_path / "load",
        {"engines": [{"name": "load", "kv_transfer_config": both, "prompts": [P3]}]},
    )
    assert result.tokens("load") == first.tokens("plain")
    assert result.totals("load")["load_errors"] >= 1


def damage_ssd_record(data_dir: Path, key: bytes) -> None:
    for segment in sorted(data_dir.rglob("*.kvf")):
        data = segment.read_bytes()
        at = data.find(key)
        if at >= 0:
            with open(segment, "r+b") as f:
                f.seek(at + 16 * 1024)  # well inside the payload
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0xFF]))
            return
    raise AssertionError("no SSD record holds the key")


def test_two_process_engine_saves_and_loads(node, job_runner, tmp_path, reuse_job) -> None:
    """The default engine: scheduler and worker connectors live in different processes."""
    result = job_runner(
        tmp_path,
        {
            "multiprocessing": True,
            "engines": [
                {
                    "name": "mp",
                    "kv_transfer_config": kvfabric_connector(role="kv_both", socket=node.socket),
                    "prompts": [P4, P4],
                    "reset_prefix_cache_after": [0],
                }
            ],
        },
    )
    assert result.cached("mp") == [0, PROMPT_LEN - 1]
    first, second = result.tokens("mp")
    assert first == second == reuse_job.tokens("plain")[3]
