"""A frozen daemon never holds an engine's forward pass for long.

The worker's real save path (:class:`WorkerSide`, one rank, a paged CPU cache in vLLM's
block layout) against a real daemon that the test freezes with SIGSTOP, as a node under
memory pressure or a debugger would: the step that meets the frozen daemon costs at most
the saves' round-trip deadline (``rpc_timeout_s``), its saves are dropped and counted,
later steps skip saving at once (counted as skipped) instead of waiting, and once the daemon
runs again the saves resume by themselves."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes, token_bytes
from kvfabric.spec import KVSpec
from kvfabric_connectors.vllm.metadata import ChunkSlice, KVFabricMetadata, RequestTransfer
from kvfabric_connectors.vllm.namespace import Namespaces, rank_share
from kvfabric_connectors.vllm.settings import ConnectorSettings
from kvfabric_connectors.vllm.worker import WorkerSide

LAYERS, KV_HEADS, HEAD_DIM, CHUNK, BLOCK, NUM_BLOCKS = 4, 2, 64, 32, 32, 8
SPEC = KVSpec(
    num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16", chunk_tokens=32
)
RPC_TIMEOUT_S = 0.5
RETRY_AFTER_S = 2.0  # the link's first back-off window (DaemonLink's default)


def prompt(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(2 * CHUNK)]  # two full chunks


def saves(namespaces: Namespaces, seed: int) -> KVFabricMetadata:
    ns = namespaces.get("", "")
    tokens = prompt(seed)
    chunks = tuple(
        ChunkSlice(
            ref.key,
            ref.parent,
            i * CHUNK,
            ref.num_tokens,
            tokens=token_bytes(tokens[i * CHUNK : (i + 1) * CHUNK]),
        )
        for i, ref in enumerate(chunk_hashes(ns, tokens))
    )
    return KVFabricMetadata(saves=(RequestTransfer(f"req-{seed}", "", "", (3, 1), chunks),))


class Engine:
    """One rank's worker and its paged cache; ``step`` is a forward pass that saves."""

    def __init__(self, socket: str, namespaces: Namespaces) -> None:
        settings = ConnectorSettings.from_extra_config(
            {"socket_path": socket, "rpc_timeout_s": RPC_TIMEOUT_S}
        )
        self.namespaces = namespaces
        self.worker = WorkerSide(
            settings, namespaces, BLOCK, torch.bfloat16, rank_share(SPEC, 0, 1)
        )
        self.caches = {
            f"model.layers.{i}.self_attn.attn": torch.randn(
                NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM
            ).to(torch.bfloat16)
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.caches)

    def step(self, seed: int) -> float:
        """Seconds the forward pass spent in the connector's saves."""
        meta = saves(self.namespaces, seed)
        started = time.monotonic()
        for name, cache in self.caches.items():
            self.worker.save_layer(meta, name, cache)
        self.worker.finish_step()
        return time.monotonic() - started

    def held(self, socket: str, seed: int) -> int:
        ns = self.namespaces.get("", "")
        with Client(socket) as client:
            keys = [ref.key for ref in chunk_hashes(ns, prompt(seed))]
            return client.lookup(ns, keys=keys).matched_chunks


@pytest.fixture
def engine_and_daemon(start_daemon):
    daemon = start_daemon("store.tiers.dram.capacity=64MiB")
    engine = Engine(daemon.socket, Namespaces("save-stall", SPEC))
    yield engine, daemon
    daemon.proc.send_signal(signal.SIGCONT)  # whatever the test did, the daemon can stop
    engine.worker.close()


def test_a_frozen_daemon_costs_one_step_its_deadline_then_nothing(engine_and_daemon) -> None:
    engine, daemon = engine_and_daemon
    healthy = engine.step(seed=1)
    assert engine.held(daemon.socket, seed=1) == 2
    counters = engine.worker.counters
    assert counters.totals()["saved_chunks"] == 2

    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        stalled = engine.step(seed=2)  # meets the frozen daemon: waits out the deadline once
        # one round trip's deadline, with room for a loaded machine, never the load deadline
        assert RPC_TIMEOUT_S * 0.9 <= stalled < RPC_TIMEOUT_S + 1.5 + healthy
        assert counters.totals()["save_errors"] == 2
        skipped = [engine.step(seed=3 + i) for i in range(5)]  # later steps do not wait
        assert max(skipped) < RPC_TIMEOUT_S / 2
        assert counters.totals()["save_skipped_chunks"] == 10
    finally:
        daemon.proc.send_signal(signal.SIGCONT)

    time.sleep(RETRY_AFTER_S + 0.2)  # the back-off ends: saving resumes by itself
    engine.step(seed=10)
    assert engine.held(daemon.socket, seed=10) == 2
    assert counters.totals()["saved_chunks"] == 4
    assert engine.held(daemon.socket, seed=2) == 0  # dropped, never half-stored
