"""Tensor parallelism in the vLLM connector: each rank's share of the canonical object
(:func:`rank_share`), and the worker's real save and load code run as several ranks against
a real daemon.

Each simulated rank is a :class:`WorkerSide` with its own connections and its own paged CPU
cache (vLLM's block layout, holding only the rank's KV heads), as a tensor-parallel worker
process would have. Producers of R ranks save a prompt, consumers of S ranks load it into
fresh caches; every consumer rank must end up with exactly its heads of the reference KV.
Across two nodes (real daemons, a real redis-server): only rank 0 pushes a producer's
chunks, and consumer ranks that all ask their daemon to pull the same chunks at once each
get their heads.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch
from cluster_nodes import tokens_held

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes, token_bytes
from kvfabric.spec import AttentionKind, KVSpec, Namespace
from kvfabric_connectors.vllm.metadata import ChunkSlice, KVFabricMetadata, RequestTransfer
from kvfabric_connectors.vllm.namespace import Namespaces, RankShare, rank_share
from kvfabric_connectors.vllm.settings import ConnectorSettings
from kvfabric_connectors.vllm.worker import WorkerSide

LAYERS, HEAD_DIM, CHUNK, BLOCK = 2, 64, 32, 32
PROMPT = list(range(500, 580))  # chunks of 32, 32 and a partial 16
BLOCK_IDS = (5, 2, 7)  # deliberately out of order
NUM_BLOCKS = 9


def spec(kv_heads: int, kind: AttentionKind = AttentionKind.MHA) -> KVSpec:
    return KVSpec(
        num_layers=LAYERS,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        kind=kind,
        chunk_tokens=CHUNK,
    )


# -- the arithmetic --------------------------------------------------------------------------


def saved_heads(kv_spec: KVSpec, tp: int) -> list[int]:
    """Every head the saving ranks of a tensor-parallel group write, with repeats."""
    out: list[int] = []
    for rank in range(tp):
        share = rank_share(kv_spec, rank, tp)
        if share.saves:
            start, end = share.heads or (0, kv_spec.num_kv_heads)
            out.extend(range(start, end))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_heads_split_evenly_when_tp_divides_them(tp: int) -> None:
    shares = [rank_share(spec(4), rank, tp) for rank in range(tp)]
    if tp == 1:
        assert shares == [RankShare(None, True, True)]
    else:
        per = 4 // tp
        assert [s.heads for s in shares] == [(r * per, (r + 1) * per) for r in range(tp)]
        assert all(s.saves for s in shares)
    assert [s.num_heads(spec(4)) for s in shares] == [4 // tp] * tp
    assert [s.pushes for s in shares] == [True] + [False] * (tp - 1)
    assert sorted(saved_heads(spec(4), tp)) == [0, 1, 2, 3]


@pytest.mark.parametrize("tp", [4, 8])
def test_replicated_heads_are_saved_by_their_first_replica_only(tp: int) -> None:
    replicas = tp // 2
    shares = [rank_share(spec(2), rank, tp) for rank in range(tp)]
    assert [s.heads for s in shares] == [(r // replicas, r // replicas + 1) for r in range(tp)]
    assert [s.saves for s in shares] == [r % replicas == 0 for r in range(tp)]
    assert [s.num_heads(spec(2)) for s in shares] == [1] * tp
    assert saved_heads(spec(2), tp) == [0, 1]  # each head exactly once


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mla_latent_is_replicated_and_saved_by_rank_zero(tp: int) -> None:
    mla = spec(1, AttentionKind.MLA)
    shares = [rank_share(mla, rank, tp) for rank in range(tp)]
    assert [s.heads for s in shares] == [None] * tp
    assert [s.saves for s in shares] == [True] + [False] * (tp - 1)
    assert [s.num_heads(mla) for s in shares] == [1] * tp


def test_a_single_kv_head_is_replicated_whole() -> None:
    assert [rank_share(spec(1), rank, 2) for rank in range(2)] == [
        RankShare(None, True, True),
        RankShare(None, False, False),
    ]


@pytest.mark.parametrize(
    "kv_heads, tp, rank", [(4, 3, 0), (2, 3, 1), (4, 2, 2), (4, 2, -1), (4, 0, 0)]
)
def test_impossible_splits_are_refused(kv_heads: int, tp: int, rank: int) -> None:
    with pytest.raises(ValueError):
        rank_share(spec(kv_heads), rank, tp)


# -- the worker's save and load paths, one WorkerSide per rank -------------------------------


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("tp-connector", "store.tiers.dram.capacity=64MiB")


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def reference_kv(kv_spec: KVSpec, seed: int) -> list[torch.Tensor]:
    """Canonical [2, H, T, D] KV of the prompt, per layer: every head distinct."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, kv_spec.num_kv_heads, len(PROMPT), HEAD_DIM, generator=generator).to(
            torch.bfloat16
        )
        for _ in range(LAYERS)
    ]


class Rank:
    """One simulated tensor-parallel worker: its WorkerSide and its paged CPU cache."""

    def __init__(self, socket: str, namespaces: Namespaces, share: RankShare) -> None:
        settings = ConnectorSettings.from_extra_config({"socket_path": socket})
        self.share = share
        self.worker = WorkerSide(settings, namespaces, BLOCK, torch.bfloat16, share)
        heads = share.num_heads(namespaces.spec)
        self.caches = {
            layer_name(i): torch.zeros(NUM_BLOCKS, heads, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.caches)

    def own(self, kv: torch.Tensor) -> torch.Tensor:
        start, end = self.share.heads or (0, kv.shape[1])
        return kv[:, start:end]

    def fill(self, kv: list[torch.Tensor]) -> None:
        """The engine computed the prompt: this rank's heads are in its blocks."""
        layout = self.worker._layout
        assert layout is not None
        for i in range(LAYERS):
            layout.scatter(self.caches[layer_name(i)], blocks(), 0, self.own(kv[i]))

    def save(self, meta: KVFabricMetadata) -> None:
        for i in range(LAYERS):
            self.worker.save_layer(meta, layer_name(i), self.caches[layer_name(i)])
        self.worker.finish_step()

    def load(self, meta: KVFabricMetadata) -> set[int]:
        self.worker.start_load(meta)
        for i in range(LAYERS):
            self.worker.wait_for_layer(layer_name(i))
        self.worker.finish_step()
        return self.worker.take_failed_blocks()

    def held(self) -> list[torch.Tensor]:
        layout = self.worker._layout
        assert layout is not None
        return [
            layout.gather(self.caches[layer_name(i)], blocks(), 0, len(PROMPT))
            for i in range(LAYERS)
        ]

    def close(self) -> None:
        self.worker.close()


def blocks() -> torch.Tensor:
    return torch.tensor(BLOCK_IDS, dtype=torch.int64)


def group(socket: str, namespaces: Namespaces, tp: int) -> list[Rank]:
    return [Rank(socket, namespaces, rank_share(namespaces.spec, r, tp)) for r in range(tp)]


def own_tokens(index: int, num_tokens: int) -> bytes:
    """Chunk ``index``'s token ids, as the scheduler gives them with a save."""
    return token_bytes(PROMPT[index * CHUNK : index * CHUNK + num_tokens])


def transfer(
    ns: Namespace, req_id: str, *, push_to: str | None = None, background: bool = False
) -> RequestTransfer:
    """The prompt's chunks; each with its token ids, as a save carries them."""
    chunks = tuple(
        ChunkSlice(
            ref.key, ref.parent, i * CHUNK, ref.num_tokens, tokens=own_tokens(i, ref.num_tokens)
        )
        for i, ref in enumerate(chunk_hashes(ns, PROMPT))
    )
    return RequestTransfer(req_id, ns.tenant_salt, "", BLOCK_IDS, chunks, push_to, background)


def matched_chunks(socket: str, ns: Namespace) -> int:
    with Client(socket) as client:
        keys = [ref.key for ref in chunk_hashes(ns, PROMPT)]
        return client.lookup(ns, keys=keys).matched_chunks


def produce(
    socket: str,
    namespaces: Namespaces,
    tp: int,
    kv: list[torch.Tensor],
    *,
    push_to: str | None = None,
    counter: str = "saved_chunks",
) -> list[float]:
    """A producer of ``tp`` ranks computes and saves the prompt (pushing it when asked);
    ``counter`` of each rank once every rank closed (pushes ended)."""
    ns = namespaces.get("", "")
    meta = KVFabricMetadata(saves=(transfer(ns, "prefill", push_to=push_to),))
    ranks = group(socket, namespaces, tp)
    try:
        for rank in ranks:  # in an engine they run concurrently, any order
            rank.fill(kv)
            rank.save(meta)
    finally:
        for rank in ranks:
            rank.close()
    return [rank.worker.counters.totals().get(counter, 0) for rank in ranks]


def consume(socket: str, namespaces: Namespaces, tp: int, kv: list[torch.Tensor]) -> None:
    """A fresh consumer of ``tp`` ranks loads the prompt: each rank holds its heads."""
    meta = KVFabricMetadata(loads=(transfer(namespaces.get("", ""), "decode"),))
    ranks = group(socket, namespaces, tp)
    try:
        for rank in ranks:
            assert rank.load(meta) == set()
            for held, want in zip(rank.held(), kv):
                assert torch.equal(held, rank.own(want)), rank.share
    finally:
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("producers, consumers", list(itertools.product([1, 2, 4], repeat=2)))
def test_every_split_of_four_kv_heads_round_trips(daemon, producers: int, consumers: int) -> None:
    namespaces = Namespaces(f"tp-{producers}-{consumers}", spec(4))
    kv = reference_kv(namespaces.spec, seed=producers * 10 + consumers)
    assert produce(daemon.socket, namespaces, producers, kv) == [3] * producers
    assert matched_chunks(daemon.socket, namespaces.get("", "")) == 3
    consume(daemon.socket, namespaces, consumers, kv)


@pytest.mark.parametrize("producers, consumers", [(4, 1), (8, 2), (1, 8), (8, 4)])
def test_replicated_kv_heads_round_trip(daemon, producers: int, consumers: int) -> None:
    """Two KV heads over 4 or 8 ranks (vLLM replicates each head): one replica saves."""
    namespaces = Namespaces(f"tp-gqa-{producers}-{consumers}", spec(2))
    kv = reference_kv(namespaces.spec, seed=100 + producers * 10 + consumers)
    replicas = max(1, producers // 2)
    assert produce(daemon.socket, namespaces, producers, kv) == [
        3 if r % replicas == 0 else 0 for r in range(producers)
    ]
    consume(daemon.socket, namespaces, consumers, kv)


def test_a_chunk_missing_a_rank_is_no_hit_until_that_rank_saves(daemon) -> None:
    """Rank 1 of a TP=2 producer lost its saves: the half-written object is no hit (a
    consumer would wait for it in vain). The next producer's rank 1 completes it (rank 0's
    heads are already there) and it becomes a hit that loads exactly."""
    namespaces = Namespaces("tp-missing-rank", spec(4))
    ns = namespaces.get("", "")
    kv = reference_kv(namespaces.spec, seed=7)
    meta = KVFabricMetadata(saves=(transfer(ns, "prefill"),))
    first = group(daemon.socket, namespaces, 2)
    try:
        first[0].fill(kv)
        first[0].save(meta)  # rank 1 never saves
        assert first[0].worker.counters.totals()["saved_chunks"] == 3
    finally:
        for rank in first:
            rank.close()
    assert matched_chunks(daemon.socket, ns) == 0
    assert produce(daemon.socket, namespaces, 2, kv) == [0, 3]
    assert matched_chunks(daemon.socket, ns) == 3
    consume(daemon.socket, namespaces, 2, kv)
    consume(daemon.socket, namespaces, 1, kv)


def test_loading_another_ranks_heads_would_be_caught(daemon) -> None:
    """Negative control of the checks above: a consumer rank given the wrong head range
    loads KV that differs from its own heads."""
    namespaces = Namespaces("tp-wrong-range", spec(4))
    kv = reference_kv(namespaces.spec, seed=11)
    produce(daemon.socket, namespaces, 1, kv)
    meta = KVFabricMetadata(loads=(transfer(namespaces.get("", ""), "decode"),))
    wrong = Rank(daemon.socket, namespaces, RankShare((2, 4), True, False))
    try:
        assert wrong.load(meta) == set()
        assert not torch.equal(wrong.held()[0], kv[0][:, 0:2])
        assert torch.equal(wrong.held()[0], kv[0][:, 2:4])
    finally:
        wrong.close()


def test_saves_give_the_daemon_each_chunks_token_ids(start_daemon) -> None:
    """Every rank's save passes its chunks' token ids; the daemon keeps them (what a peer's
    ``peer_pin`` reads). Negative control: a chunk whose ids are not its own is refused."""
    daemon = start_daemon("store.tiers.dram.capacity=64MiB", "tcp.port=0")
    namespaces = Namespaces("tp-tokens", spec(4))
    ns = namespaces.get("", "")
    kv = reference_kv(namespaces.spec, seed=13)
    good = transfer(ns, "prefill")
    wrong = dataclasses.replace(good.chunks[1], tokens=good.chunks[0].tokens)
    bad = dataclasses.replace(good, chunks=(good.chunks[0], wrong, good.chunks[2]))
    ranks = group(daemon.socket, namespaces, 2)
    try:
        for rank in ranks:
            rank.fill(kv)
            rank.save(KVFabricMetadata(saves=(bad,)))
        assert [r.worker.counters.totals().get("save_errors") for r in ranks] == [1, 1]
    finally:
        for rank in ranks:
            rank.close()
    keys = [c.key for c in good.chunks]
    with Client(daemon.socket) as client:
        assert client.contains(ns, keys) == [True, False, True]
    assert produce(daemon.socket, namespaces, 2, kv) == [1, 1]  # the refused chunk only
    assert tokens_held(daemon.info["tcp_port"], ns, keys) == [c.tokens for c in good.chunks]
    consume(daemon.socket, namespaces, 1, kv)


# -- across nodes: a TP producer's push, TP consumer ranks pulling at once --------------------


def node(start_daemon, redis_url: str, name: str):
    return start_daemon(
        "store.tiers.dram.capacity=64MiB",
        f"node_id={name}",
        "cluster.index=redis",
        f"cluster.redis_url={redis_url}",
        "cluster.heartbeat_s=0.2",
        "tcp.port=0",
        "cluster.transport=socket",
    )


def test_only_rank_zero_pushes_and_the_target_gets_whole_objects(
    start_daemon, redis_server
) -> None:
    prefill = node(start_daemon, redis_server.url, "prefill-a")
    decode = node(start_daemon, redis_server.url, "decode-b")
    namespaces = Namespaces("tp-push", spec(4))
    kv = reference_kv(namespaces.spec, seed=31)
    assert produce(
        prefill.socket, namespaces, 2, kv, push_to="decode-b", counter="pushed_chunks"
    ) == [3, 0]
    prefill.kill()  # what the consumer loads can only have come by push
    assert matched_chunks(decode.socket, namespaces.get("", "")) == 3
    consume(decode.socket, namespaces, 2, kv)


def test_consumer_ranks_pull_together_in_the_background(start_daemon, redis_server) -> None:
    prefill = node(start_daemon, redis_server.url, "prefill-a")
    decode = node(start_daemon, redis_server.url, "decode-b")
    namespaces = Namespaces("tp-pull", spec(4))
    ns = namespaces.get("", "")
    kv = reference_kv(namespaces.spec, seed=41)
    produce(prefill.socket, namespaces, 2, kv)
    keys = [ref.key for ref in chunk_hashes(ns, PROMPT)]
    with Client(decode.socket) as client:  # the global index learns of them
        deadline = time.monotonic() + 10
        while client.lookup(ns, keys=keys, scope="cluster").cluster_chunks != 3:
            assert time.monotonic() < deadline, "the chunks never reached the global index"
            time.sleep(0.1)
    meta = KVFabricMetadata(loads=(transfer(ns, "decode", background=True),))
    ranks = group(decode.socket, namespaces, 2)
    try:
        for rank in ranks:  # both ranks ask the daemon to pull the same chunks at once
            rank.worker.start_load(meta)
        for rank in ranks:
            deadline = time.monotonic() + 20
            while "decode" not in rank.worker.take_load_results()[0]:
                assert time.monotonic() < deadline, "background load never ended"
                time.sleep(0.05)
            assert rank.worker.take_failed_blocks() == set()
            for held, want in zip(rank.held(), kv):
                assert torch.equal(held, rank.own(want)), rank.share
    finally:
        for rank in ranks:
            rank.close()
    assert matched_chunks(decode.socket, ns) == 3
