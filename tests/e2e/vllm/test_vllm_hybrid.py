"""Hybrid attention: KVFabricConnector with vLLM's hybrid KV cache manager (HMA) on.

The model is the tiny Llama with layers 0 and 2 sliding-window (WINDOW tokens) and 1 and 3
full attention, built at test time (:func:`sliding_llama`); with HMA vLLM gives it two KV
cache groups and frees sliding-window blocks once the window has passed them. The connector
declares ``SupportsHMA``, so HMA stays on with it (without that vLLM turns HMA off). Claims
(greedy outputs, compared with an engine without a connector):

* **HMA on, two groups**: every engine here reports HMA on and a sliding-window and a
  full-attention group.
* **prefix reuse**: a fresh engine loads a stored prompt from the fabric (all but its last
  token) and a prompt sharing two full chunks with it (512 tokens), with identical outputs.
* **a sliding-window set stores only what is live**: with chunked prefill of 64 tokens the
  window has slid past the first two chunks when they complete, so only the last chunk's
  sliding-window layers are stored (the full-attention layers of all three); a fresh engine
  still loads that prompt (it needs only the last window), with identical outputs, while a
  prompt sharing its first 512 tokens loads nothing: the windows it would need are absent.
* **negative controls**: noise in place of a stored chunk's sliding-window layers changes
  the output (they are loaded and used); a withheld one makes the consumer stop at the
  previous chunk boundary whose window is held, with identical outputs.
* **two processes**: vLLM's default engine (scheduler and worker connectors apart) loads
  with HMA on too.
* **SSM hybrid**: a tiny Qwen3-Next (linear attention with a recurrent state + full
  attention) starts and serves with the connector, HMA on, outputs identical to no
  connector; the connector moves nothing for it (state cannot be rebuilt from KV chunks).
  What vLLM 0.32's CPU build could not run, with or without a connector: a tiny Granite-4
  (GraniteMoeHybrid, Mamba2) fails in its engine start with prefix caching on
  (``IndexError: index 2 is out of bounds for dimension 0 with size 1`` in
  ``mamba_mixer2.conv_ssm_forward``; it runs with prefix caching off), a tiny Jamba
  (Mamba1) with ``IndexError: Dimension out of range (expected to be in range of [-2, 1],
  but got 2)`` in ``mamba_mixer.forward_impl``; Bamba is gone from vLLM's registry.
  Before SupportsHMA, vLLM turned HMA off for the connector, and the Granite-4 (prefix
  caching off) failed to start with it: ``ValueError: Failed to promote local KV cache
  specs to one unified type.``
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from engine_jobs import kvfabric_connector
from transformers import AutoConfig

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import Namespace
from kvfabric_connectors.hf import namespace_for
from kvfabric_connectors.vllm.groups import LayerSet

CHUNK = 256
WINDOW = 100
BLOCK = 32
PROMPT_LEN = 700  # chunks of 256, 256 and 188 tokens
SHARED = 600  # shares two full chunks (512 tokens)
SMALL = ["store.tiers.dram.capacity=256MiB"]
SWA_LAYERS = (0, 2)
FULL_LAYERS = (1, 3)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def sliding_llama(base: Path, out: Path, *, window: int, layers: int = 4) -> Path:
    """The tiny Llama with even layers sliding-window (``window`` tokens), odd ones full:
    vLLM's Llama reads ``layer_types`` and ``sliding_window``; the weights are the same."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == layers, config
    config["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    config["sliding_window"] = window
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def tiny_qwen3_next(base: Path, out: Path) -> Path:
    """A random-weight 4-layer Qwen3-Next (gated delta-net linear attention, a recurrent
    state, at layers 0 and 2, full attention at 1 and 3; a small MoE), with the tiny
    Llama's tokenizer: the SSM hybrid vLLM's CPU build runs."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


P1 = prompt(1)
P2 = P1[:SHARED] + prompt(2, PROMPT_LEN - SHARED)
P3 = prompt(3)
P4 = P3[:SHARED] + prompt(4, PROMPT_LEN - SHARED)
P5 = prompt(5)


def namespaces(model: Path) -> tuple[Namespace, Namespace]:
    """The connector's full-attention and sliding-window namespaces of the model."""
    base = namespace_for(str(model), AutoConfig.from_pretrained(model), chunk_tokens=CHUNK)
    spec = dataclasses.replace(base.spec, num_layers=2)
    full = Namespace(base.model_id + LayerSet(FULL_LAYERS).tag(), spec)
    window = Namespace(base.model_id + LayerSet(SWA_LAYERS, WINDOW).tag(), spec)
    return full, window


def engine(name: str, prompts: list[list[int]], connector: dict | None, **extra) -> dict:
    return {
        "name": name,
        "prompts": prompts,
        "block_size": BLOCK,
        "kv_transfer_config": connector,
        **extra,
    }


@pytest.fixture(scope="module")
def swa_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sliding_llama(tiny_model, tmp_path_factory.mktemp("swa") / "model", window=WINDOW)


@pytest.fixture(scope="module")
def node(start_module_daemon):
    return start_module_daemon("hybrid-node", *SMALL)


@pytest.fixture(scope="module")
def job(swa_model, node, job_runner, tmp_path_factory) -> dict:
    both = kvfabric_connector(node.socket)
    return job_runner(
        tmp_path_factory.mktemp("hybrid"),
        {
            "model": str(swa_model),
            "engines": [
                engine("plain", [P1, P2, P3, P4, P5], None),
                engine("store", [P1, P5], both),
                engine("reuse", [P1, P2], both, reset_prefix_cache_after=[0]),
                engine("chunked-store", [P3], both, max_num_batched_tokens=64),
                engine("chunked-reuse", [P3, P4], both, reset_prefix_cache_after=[0]),
            ],
        },
    )


def test_hma_is_on_with_a_sliding_window_and_a_full_attention_group(job) -> None:
    for record in job["engines"]:
        assert record["hybrid_kv_cache_manager"], record["name"]
        groups = {g["spec"]: g for g in record["kv_cache_groups"]}
        assert set(groups) == {"SlidingWindowSpec", "FullAttentionSpec"}, record["name"]
        assert groups["SlidingWindowSpec"]["sliding_window"] == WINDOW


def test_prefix_reuse_across_fresh_engines_gives_identical_outputs(job) -> None:
    assert job.cached("store") == [0, 0]
    assert job.totals("store")["saved_chunks"] == 12  # 3 chunks x 2 layer sets x 2 prompts
    assert job.tokens("store") == [job.tokens("plain")[0], job.tokens("plain")[4]]
    assert job.cached("reuse") == [PROMPT_LEN - 1, 2 * CHUNK]
    assert job.tokens("reuse") == job.tokens("plain")[:2]


def test_a_sliding_window_set_stores_only_live_chunks(job, node, swa_model) -> None:
    full, window = namespaces(swa_model)
    with Client(node.socket) as client:
        held_full = client.contains(full, [r.key for r in chunk_hashes(full, P3)])
        held_window = client.contains(window, [r.key for r in chunk_hashes(window, P3)])
    assert list(held_full) == [True, True, True]
    assert list(held_window) == [False, False, True]  # the window slid past chunks 0, 1
    assert job.totals("chunked-store")["saved_chunks"] == 4
    assert job.tokens("chunked-store") == job.tokens("plain")[2:3]
    # the last window is all a consumer of the whole prompt needs
    assert job.cached("chunked-reuse")[0] == PROMPT_LEN - 1
    assert job.tokens("chunked-reuse")[0] == job.tokens("plain")[2]
    # a prompt that stops at 512 needs chunk 1's window, at 256 chunk 0's: neither is held
    assert job.cached("chunked-reuse")[1] == 0
    assert job.tokens("chunked-reuse")[1] == job.tokens("plain")[3]


def test_two_process_engine_loads_with_hma(job, node, swa_model, job_runner, tmp_path) -> None:
    """vLLM's default engine: the scheduler's connector (and vLLM's block tables it reads)
    in EngineCore, the worker's in another process. P2's last chunk was saved by "reuse"
    (its window blocks were live: that step computed all of it)."""
    result = job_runner(
        tmp_path,
        {
            "model": str(swa_model),
            "multiprocessing": True,
            "engines": [engine("mp", [P2], kvfabric_connector(node.socket))],
        },
    )
    assert result.engine("mp")["hybrid_kv_cache_manager"]
    assert result.cached("mp") == [PROMPT_LEN - 1]
    assert result.tokens("mp") == job.tokens("plain")[1:2]


def test_negative_control_noise_in_the_window_layers_changes_the_output(
    job, node, swa_model, job_runner, tmp_path
) -> None:
    _, window = namespaces(swa_model)
    last = chunk_hashes(window, P1)[-1]
    noise = torch.Generator().manual_seed(0)
    with Client(node.socket) as client:
        assert client.delete(window, last.key)
        values = window.spec.layout(last.num_tokens).nbytes // 2
        payload = torch.randn(values, generator=noise).to(torch.bfloat16)  # plausible KV
        assert client.put(window, last.key, payload, parent=last.parent, num_tokens=last.num_tokens)
    result = job_runner(
        tmp_path,
        {
            "model": str(swa_model),
            "engines": [engine("corrupt", [P1], kvfabric_connector(node.socket))],
        },
    )
    assert result.cached("corrupt") == [PROMPT_LEN - 1]  # the noise was loaded
    assert result.tokens("corrupt") != job.tokens("plain")[:1]


def test_negative_control_a_withheld_window_stops_the_load_where_one_is_held(
    job, node, swa_model, job_runner, tmp_path
) -> None:
    _, window = namespaces(swa_model)
    with Client(node.socket) as client:
        assert client.delete(window, chunk_hashes(window, P5)[-1].key)
    result = job_runner(
        tmp_path,
        {
            "model": str(swa_model),
            "engines": [engine("withheld", [P5], kvfabric_connector(node.socket))],
        },
    )
    assert result.cached("withheld") == [2 * CHUNK]  # chunk 1 holds the window before 512
    assert result.tokens("withheld") == job.tokens("plain")[4:5]


def test_an_ssm_hybrid_starts_and_serves_with_the_connector(
    tiny_model, start_daemon, job_runner, tmp_path
) -> None:
    model = tiny_qwen3_next(tiny_model, tmp_path / "qwen3-next")
    daemon = start_daemon(*SMALL)
    both = kvfabric_connector(daemon.socket)
    result = job_runner(
        tmp_path / "job",
        {
            "model": str(model),
            "engines": [
                {"name": "plain", "prompts": [P1]},
                {"name": "fabric", "prompts": [P1, P1], "kv_transfer_config": both},
            ],
        },
    )
    record = result.engine("fabric")
    assert record["hybrid_kv_cache_manager"]
    assert {g["spec"] for g in record["kv_cache_groups"]} == {"MambaSpec", "FullAttentionSpec"}
    assert result.tokens("fabric") == result.tokens("plain") * 2
    assert record["connector_totals"].get("saved_chunks", 0) == 0  # state is not KV
