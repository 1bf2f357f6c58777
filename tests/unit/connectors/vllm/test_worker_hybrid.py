"""Worker side with several KV cache groups: each layer saves from and loads into its own
group's blocks, a layer set's objects hold that set's layers only, null entries are never
written, and a failed load is reported per request (vLLM cannot map block ids of several
groups back to requests), against a real daemon."""

from __future__ import annotations

import time

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvfabric.hashing import chunk_hashes, token_bytes
from kvfabric.spec import KVSpec
from kvfabric_connectors.vllm.groups import layer_plan
from kvfabric_connectors.vllm.metadata import ChunkSlice, KVFabricMetadata, RequestTransfer
from kvfabric_connectors.vllm.namespace import Namespaces, rank_share
from kvfabric_connectors.vllm.settings import ConnectorSettings
from kvfabric_connectors.vllm.worker import WorkerSide

LAYERS, HEADS, HEAD_DIM, CHUNK, BLOCK, WINDOW = 4, 2, 64, 32, 32, 40
PROMPT = list(range(700, 780))  # chunks of 32, 32 and a partial 16
NUM_BLOCKS = 10
NULL = 0
FULL, WINDOWED = 0, 1  # layer sets: layers 1, 3 (group 1) and 0, 2 (group 0)
SPEC = KVSpec(
    num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16", chunk_tokens=CHUNK
)


def name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def namespaces(model: str) -> Namespaces:
    attention = {"num_kv_heads": HEADS, "head_size": HEAD_DIM, "dtype": torch.bfloat16}
    groups = [
        KVCacheGroupSpec(
            [name(0), name(2)], SlidingWindowSpec(BLOCK, sliding_window=WINDOW, **attention)
        ),
        KVCacheGroupSpec([name(1), name(3)], FullAttentionSpec(BLOCK, **attention)),
    ]
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    return Namespaces(model, SPEC, layer_plan(config))


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("hybrid-worker", "store.tiers.dram.capacity=64MiB")


class Engine:
    """One worker and its paged CPU cache, a tensor per layer."""

    def __init__(self, socket: str, spaces: Namespaces) -> None:
        settings = ConnectorSettings.from_extra_config({"socket_path": socket})
        self.worker = WorkerSide(settings, spaces, BLOCK, torch.bfloat16, rank_share(SPEC, 0, 1))
        self.caches = {
            name(i): torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.caches)

    def scatter(self, layer: int, blocks: tuple[int, ...], start: int, kv: torch.Tensor) -> None:
        layout = self.worker._layout
        assert layout is not None
        layout.scatter(self.caches[name(layer)], torch.tensor(blocks), start, kv)

    def gather(self, layer: int, blocks: tuple[int, ...], start: int, count: int) -> torch.Tensor:
        layout = self.worker._layout
        assert layout is not None
        return layout.gather(self.caches[name(layer)], torch.tensor(blocks), start, count)

    def close(self) -> None:
        self.worker.close()


def reference() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(2, HEADS, len(PROMPT), HEAD_DIM, generator=generator).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def chunks(spaces: Namespaces, layer_set: int, first: int, *, saves: bool) -> tuple:
    """The prompt's chunks of one layer set from token ``first`` on (chunk-relative)."""
    refs = chunk_hashes(spaces.get("", "", layer_set), PROMPT)
    out = []
    for i, ref in enumerate(refs):
        start = i * CHUNK
        if start + ref.num_tokens <= first:
            continue
        own = token_bytes(PROMPT[start : start + ref.num_tokens]) if saves else b""
        out.append(
            ChunkSlice(ref.key, ref.parent, start, ref.num_tokens, max(0, first - start), -1, own)
        )
    return tuple(out)


def transfer(req: str, layer_set: int, chunk_slices: tuple, tables: tuple) -> RequestTransfer:
    return RequestTransfer(
        req, "", "", tables[0], chunk_slices, None, True, layer_set=layer_set, groups=tables
    )


def wait_loaded(engine: Engine, req: str) -> set[str]:
    deadline = time.monotonic() + 20
    while True:
        done, failed = engine.worker.take_load_results()
        if req in done:
            return failed
        assert time.monotonic() < deadline, "the background load never ended"
        time.sleep(0.02)


def test_each_layer_set_round_trips_through_its_own_groups_blocks(daemon) -> None:
    spaces = namespaces("hybrid-worker-round-trip")
    kv = reference()
    producer_tables = ((1, 2, 3), (4, 5, 6))  # window group, full group
    producer = Engine(daemon.socket, spaces)
    try:
        for layer in range(LAYERS):
            group = 0 if layer % 2 == 0 else 1
            producer.scatter(layer, producer_tables[group], 0, kv[layer])
        meta = KVFabricMetadata(
            saves=(
                transfer("p", FULL, chunks(spaces, FULL, 0, saves=True), producer_tables),
                # chunk 0 slid out of the window before it completed: not saved
                transfer("p", WINDOWED, chunks(spaces, WINDOWED, 32, saves=True), producer_tables),
            )
        )
        for layer in range(LAYERS):
            producer.worker.save_layer(meta, name(layer), producer.caches[name(layer)])
        producer.worker.finish_step()
        assert producer.worker.counters.totals()["saved_chunks"] == 5
    finally:
        producer.close()

    # the consumer's window group kept blocks from token 32 on: its first entry is null
    consumer_tables = ((NULL, 8, 9), (3, 2, 1))
    consumer = Engine(daemon.socket, spaces)
    try:
        meta = KVFabricMetadata(
            loads=(
                transfer("c", FULL, chunks(spaces, FULL, 0, saves=False), consumer_tables),
                transfer("c", WINDOWED, chunks(spaces, WINDOWED, 32, saves=False), consumer_tables),
            )
        )
        consumer.worker.start_load(meta)
        assert wait_loaded(consumer, "c") == set()
        for layer in (1, 3):
            assert torch.equal(consumer.gather(layer, consumer_tables[1], 0, 80), kv[layer])
        for layer in (0, 2):
            held = consumer.gather(layer, consumer_tables[0], 32, 48)
            assert torch.equal(held, kv[layer][:, :, 32:])
            assert not consumer.caches[name(layer)][NULL].any()  # the null block: untouched
        assert consumer.worker.take_failed_blocks() == set()
    finally:
        consumer.close()  # joins every background load
    # one end per request, whatever its layer sets: vLLM asserts on a second one
    assert consumer.worker.take_load_results() == (set(), set())


def test_a_failed_load_with_several_groups_is_reported_per_request(daemon) -> None:
    spaces = namespaces("hybrid-worker-failure")
    tables = ((1, 2, 3), (4, 5, 6))
    consumer = Engine(daemon.socket, spaces)
    try:  # nothing was ever saved: the chunks are missing
        meta = KVFabricMetadata(
            loads=(transfer("gone", WINDOWED, chunks(spaces, WINDOWED, 0, saves=False), tables),)
        )
        consumer.worker.start_load(meta)
        assert wait_loaded(consumer, "gone") == {"gone"}
        assert consumer.worker.take_failed_blocks() == set()  # never as block ids
    finally:
        consumer.close()
