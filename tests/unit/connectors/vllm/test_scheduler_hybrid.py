"""Scheduler side with vLLM's hybrid KV cache manager (several KV cache groups): where a
load stops, what it writes into a sliding-window group's live blocks, which chunks a
sliding-window set saves, against a real daemon."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec
from kvfabric_connectors.vllm.groups import layer_plan
from kvfabric_connectors.vllm.namespace import Namespaces
from kvfabric_connectors.vllm.scheduler import SchedulerSide
from kvfabric_connectors.vllm.settings import ConnectorSettings

BLOCK = 8
WINDOW = 10
SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=16)
PROMPT = list(range(2000, 2040))  # chunks of 16, 16 and a partial 8
NULL = 0


def plan():
    """Layers 0 and 2 sliding window (group 0), 1 and 3 full attention (group 1)."""
    attention = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    groups = [
        KVCacheGroupSpec(
            [f"model.layers.{i}.self_attn.attn" for i in (0, 2)],
            SlidingWindowSpec(BLOCK, sliding_window=WINDOW, **attention),
        ),
        KVCacheGroupSpec(
            [f"model.layers.{i}.self_attn.attn" for i in (1, 3)],
            FullAttentionSpec(BLOCK, **attention),
        ),
    ]
    return layer_plan(KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups))


NAMESPACES = Namespaces("hybrid-sched-model", SPEC, plan())
FULL, WINDOWED = 0, 1  # layer sets


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("hybrid-sched", "store.tiers.dram.capacity=64MiB")


def side(socket: str, *, loads: bool = True, saves: bool = True) -> SchedulerSide:
    settings = ConnectorSettings.from_extra_config({"socket_path": socket})
    return SchedulerSide(settings, NAMESPACES, loads=loads, saves=saves)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None)


def store(socket: str, tokens: list[int], layer_set: int, chunks: list[int]) -> None:
    ns = NAMESPACES.get("", "", layer_set)
    refs = [chunk_hashes(ns, tokens)[i] for i in chunks]
    with Client(socket) as client:
        client.put_many(
            ns, refs, [np.zeros(ns.spec.layout(r.num_tokens).nbytes, np.uint8) for r in refs]
        )


class Blocks:
    """vLLM's KVCacheBlocks as update_state_after_alloc gets them: a table per group."""

    def __init__(self, *tables: list[int]) -> None:
        self.tables = tables

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(t) for t in self.tables)


def new_step(rid: str, tokens: list[int], tables: tuple[list[int], ...], scheduled: int):
    news = [NewRequestData(rid, tokens, [], None, None, tables, 0, None)]
    return SchedulerOutput(
        news, CachedRequestData.make_empty(), {rid: scheduled}, scheduled, {}, {}, set(), []
    )


def test_a_hit_stops_where_the_window_is_held_and_loads_in_the_background(daemon) -> None:
    prompt = [t + 1 for t in PROMPT]
    store(daemon.socket, prompt, FULL, [0, 1, 2])
    sched = side(daemon.socket, saves=False)
    # no window layers at all: nothing is usable
    assert sched.get_num_new_matched_tokens(request("none", prompt), 0) == (0, False)
    store(daemon.socket, prompt, WINDOWED, [1])
    # 39 needs [24, 39): chunks 1 and 2; 32 needs [16, 32): chunk 1
    assert sched.get_num_new_matched_tokens(request("some", prompt), 0) == (32, True)
    store(daemon.socket, prompt, WINDOWED, [2])
    assert sched.get_num_new_matched_tokens(request("all", prompt), 0) == (39, True)
    sched.close()


def test_a_load_writes_window_layers_into_live_blocks_only(daemon) -> None:
    prompt = [t + 2 for t in PROMPT]
    store(daemon.socket, prompt, FULL, [0, 1, 2])
    store(daemon.socket, prompt, WINDOWED, [1, 2])
    sched = side(daemon.socket, saves=False)
    req = request("load", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (39, True)
    # vLLM skipped 30 tokens of the window group: its first three blocks are null
    window_blocks, full_blocks = [NULL, NULL, NULL, 4, 5], [11, 12, 13, 14, 15]
    sched.update_state_after_alloc(req, Blocks(window_blocks, full_blocks), 39)
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    full, windowed = meta.loads
    assert full.background and windowed.background
    assert full.groups == windowed.groups == (tuple(window_blocks), tuple(full_blocks))
    assert (full.layer_set, windowed.layer_set) == (FULL, WINDOWED)
    assert [(c.start + c.begin, c.start + c.stop) for c in full.chunks] == [
        (0, 16),
        (16, 32),
        (32, 39),
    ]
    # the window group from its first live block (token 24) on, nothing before
    assert [(c.start + c.begin, c.start + c.stop) for c in windowed.chunks] == [
        (24, 32),
        (32, 39),
    ]
    window_refs = chunk_hashes(NAMESPACES.get("", "", WINDOWED), prompt)
    assert [c.key for c in windowed.chunks] == [window_refs[1].key, window_refs[2].key]
    sched.close()


def test_a_failed_background_load_is_not_offered_again(daemon) -> None:
    prompt = [t + 3 for t in PROMPT]
    store(daemon.socket, prompt, FULL, [0, 1, 2])
    store(daemon.socket, prompt, WINDOWED, [0, 1, 2])
    sched = side(daemon.socket, saves=False)
    req = request("fails", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (39, True)
    sched.update_state_after_alloc(req, Blocks([1] * 5, [2] * 5), 39)
    sched.build_connector_meta(SchedulerOutput.make_empty())
    with Client(daemon.socket) as client:  # lost before the retry asks again
        ns = NAMESPACES.get("", "", FULL)
        assert client.delete(ns, chunk_hashes(ns, prompt)[0].key)
    sched.update_connector_output(
        KVConnectorOutput(finished_recving={"fails"}, failed_recving={"fails"})
    )
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.close()


def test_window_layers_are_saved_only_from_live_blocks(daemon) -> None:
    prompt = [t + 4 for t in PROMPT]
    sched = side(daemon.socket, loads=False)
    # vLLM's tables now: the window slid past chunk 0's blocks (freed: null)
    window_blocks, full_blocks = [NULL, NULL, 3, 4, 5], [11, 12, 13, 14, 15]
    sched.bind_blocks(lambda rid: (window_blocks, full_blocks), NULL)
    sched.get_num_new_matched_tokens(request("save", prompt), 0)
    meta = sched.build_connector_meta(new_step("save", prompt, ([], []), 40))
    full, windowed = meta.saves
    assert [c.start for c in full.chunks] == [0, 16, 32]
    assert [c.start for c in windowed.chunks] == [16, 32]  # chunk 0's blocks are gone
    assert windowed.groups == (tuple(window_blocks), tuple(full_blocks))
    window_refs = chunk_hashes(NAMESPACES.get("", "", WINDOWED), prompt)
    assert [c.key for c in windowed.chunks] == [window_refs[1].key, window_refs[2].key]
    assert all(c.tokens for c in windowed.chunks)  # each with its token ids
    sched.close()


def test_without_vllms_tables_no_window_layers_are_saved(daemon) -> None:
    prompt = [t + 5 for t in PROMPT]
    sched = side(daemon.socket, loads=False)
    sched.get_num_new_matched_tokens(request("blind", prompt), 0)
    meta = sched.build_connector_meta(new_step("blind", prompt, ([1] * 5, [2] * 5), 40))
    (full,) = meta.saves
    assert full.layer_set == FULL and len(full.chunks) == 3
    sched.close()
