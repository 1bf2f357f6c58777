"""The worker's real save and load paths on MLA caches, against a real daemon.

Each simulated tensor-parallel rank is a :class:`WorkerSide` with an MLA spec (one latent
"head" of 576 values) and its own paged cache shaped as vLLM 0.32 hands it to connectors,
``[num_blocks, 1, block_size, 576]``. vLLM replicates the latent on every rank: every rank
must pick the MLA layout, only rank 0 saves, and every consumer rank loads the whole latent,
whatever the producer's parallelism.
"""

from __future__ import annotations

import pytest
import torch

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes, token_bytes
from kvfabric.spec import AttentionKind, KVSpec, Namespace
from kvfabric_connectors.vllm.metadata import ChunkSlice, KVFabricMetadata, RequestTransfer
from kvfabric_connectors.vllm.mla_layout import MlaBlockLayout
from kvfabric_connectors.vllm.namespace import Namespaces, rank_share
from kvfabric_connectors.vllm.settings import ConnectorSettings
from kvfabric_connectors.vllm.worker import WorkerSide

LAYERS, LATENT, CHUNK, BLOCK = 2, 576, 32, 16
PROMPT = list(range(700, 780))  # chunks of 32, 32 and a partial 16
BLOCK_IDS = (9, 2, 7, 4, 0)  # out of order; 80 tokens in blocks of 16
NUM_BLOCKS = 11
SPEC = KVSpec(
    num_layers=LAYERS,
    num_kv_heads=1,
    head_dim=LATENT,
    dtype="bfloat16",
    kind=AttentionKind.MLA,
    chunk_tokens=CHUNK,
)


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("mla-connector", "store.tiers.dram.capacity=64MiB")


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def latents(seed: int) -> list[torch.Tensor]:
    """Canonical [1, 1, T, latent] of the prompt, per layer."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, 1, len(PROMPT), LATENT, generator=generator).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def blocks() -> torch.Tensor:
    return torch.tensor(BLOCK_IDS, dtype=torch.int64)


class Rank:
    """One simulated worker: its WorkerSide and its MLA cache (random: stale data around)."""

    def __init__(self, socket: str, namespaces: Namespaces, rank: int, tp: int) -> None:
        settings = ConnectorSettings.from_extra_config({"socket_path": socket})
        share = rank_share(namespaces.spec, rank, tp)
        self.worker = WorkerSide(settings, namespaces, BLOCK, torch.bfloat16, share)
        generator = torch.Generator().manual_seed(1000 + rank)
        self.caches = {
            layer_name(i): torch.randn(NUM_BLOCKS, 1, BLOCK, LATENT, generator=generator).to(
                torch.bfloat16
            )
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.caches)
        assert isinstance(self.worker._layout, MlaBlockLayout)
        self.layout: MlaBlockLayout = self.worker._layout

    def fill(self, kv: list[torch.Tensor]) -> None:
        for i in range(LAYERS):
            self.layout.scatter(self.caches[layer_name(i)], blocks(), 0, kv[i])

    def held(self) -> list[torch.Tensor]:
        return [
            self.layout.gather(self.caches[layer_name(i)], blocks(), 0, len(PROMPT))
            for i in range(LAYERS)
        ]


def transfer(ns: Namespace, req_id: str) -> RequestTransfer:
    chunks = tuple(
        ChunkSlice(
            ref.key,
            ref.parent,
            i * CHUNK,
            ref.num_tokens,
            tokens=token_bytes(PROMPT[i * CHUNK : i * CHUNK + ref.num_tokens]),
        )
        for i, ref in enumerate(chunk_hashes(ns, PROMPT))
    )
    return RequestTransfer(req_id, ns.tenant_salt, "", BLOCK_IDS, chunks, None, False)


def produce(socket: str, namespaces: Namespaces, tp: int, kv: list[torch.Tensor]) -> list[int]:
    """A producer of ``tp`` ranks computed the prompt and saves it; each rank's saved chunks."""
    meta = KVFabricMetadata(saves=(transfer(namespaces.get("", ""), "prefill"),))
    ranks = [Rank(socket, namespaces, r, tp) for r in range(tp)]
    try:
        for rank in ranks:
            rank.fill(kv)
            for i in range(LAYERS):
                rank.worker.save_layer(meta, layer_name(i), rank.caches[layer_name(i)])
            rank.worker.finish_step()
    finally:
        for rank in ranks:
            rank.worker.close()
    return [rank.worker.counters.totals().get("saved_chunks", 0) for rank in ranks]


def consume(socket: str, namespaces: Namespaces, tp: int) -> list[list[torch.Tensor]]:
    """A fresh consumer of ``tp`` ranks loads the prompt; what each rank's blocks hold."""
    meta = KVFabricMetadata(loads=(transfer(namespaces.get("", ""), "decode"),))
    ranks = [Rank(socket, namespaces, r, tp) for r in range(tp)]
    try:
        for rank in ranks:
            rank.worker.start_load(meta)
            for i in range(LAYERS):
                rank.worker.wait_for_layer(layer_name(i))
            rank.worker.finish_step()
            assert rank.worker.take_failed_blocks() == set()
        return [rank.held() for rank in ranks]
    finally:
        for rank in ranks:
            rank.worker.close()


@pytest.mark.parametrize("producers, consumers", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_latent_round_trips_across_tensor_parallel_sizes(
    daemon, producers: int, consumers: int
) -> None:
    namespaces = Namespaces(f"mla-{producers}-{consumers}", SPEC)
    kv = latents(seed=producers * 10 + consumers)
    assert produce(daemon.socket, namespaces, producers, kv) == [3] + [0] * (producers - 1)
    with Client(daemon.socket) as client:
        keys = [ref.key for ref in chunk_hashes(namespaces.get("", ""), PROMPT)]
        assert client.lookup(namespaces.get("", ""), keys=keys).matched_chunks == 3
    for held in consume(daemon.socket, namespaces, consumers):
        assert all(torch.equal(h, want) for h, want in zip(held, kv))


def test_negative_control_another_prompts_latent_does_not_match(daemon) -> None:
    """The comparison above can fail: a consumer of a prompt stored with other latents holds
    those, not the reference."""
    namespaces = Namespaces("mla-other", SPEC)
    produce(daemon.socket, namespaces, 1, latents(seed=1))
    (held,) = consume(daemon.socket, namespaces, 1)
    assert not torch.equal(held[0], latents(seed=2)[0])
    assert torch.equal(held[0], latents(seed=1)[0])
