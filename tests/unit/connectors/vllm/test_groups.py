"""Hybrid attention (kvfabric_connectors/vllm/groups.py): vLLM's KV cache groups as layer
sets, where a sliding-window set's live blocks start, and where a consumer can stop."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvfabric.spec import KVSpec
from kvfabric_connectors.vllm.groups import (
    LayerSet,
    Placement,
    all_live,
    first_live_token,
    layer_plan,
    live_start,
    usable_stop,
)
from kvfabric_connectors.vllm.namespace import Namespaces

BLOCK = 32
SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, chunk_tokens=256)


def name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def full() -> FullAttentionSpec:
    return FullAttentionSpec(BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def window(size: int = 100) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=size
    )


def config(*groups: tuple[list[int], object]) -> KVCacheConfig:
    specs = [KVCacheGroupSpec([name(i) for i in layers], spec) for layers, spec in groups]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=specs)


def hybrid():
    """Gemma-style: layers 0 and 2 sliding window (group 0), 1 and 3 full (group 1)."""
    plan = layer_plan(config(([2, 0], window()), ([1, 3], full())))
    assert plan is not None
    return plan


def test_groups_become_layer_sets_full_attention_first() -> None:
    plan = hybrid()
    assert plan.sets == (LayerSet((1, 3)), LayerSet((0, 2), 100))
    assert plan.place[name(3)] == Placement(0, 1, 1)
    assert plan.place[name(0)] == Placement(1, 0, 0)
    assert plan.place[name(2)] == Placement(1, 1, 0)
    assert plan.set_groups == ((1,), (0,))
    assert plan.async_loads and not plan.legacy and not plan.inert


def test_one_full_attention_group_keeps_the_namespace_it_always_had() -> None:
    plan = layer_plan(config(([0, 1, 2, 3], full())))
    assert plan is not None and plan.legacy and not plan.async_loads
    assert Namespaces("m", SPEC, plan).get("", "") == Namespaces("m", SPEC).get("", "")


def test_each_layer_set_is_a_namespace_of_its_own() -> None:
    spaces = Namespaces("m", SPEC, hybrid())
    full_ns, window_ns = spaces.get("t", "", 0), spaces.get("t", "", 1)
    assert (full_ns.model_id, full_ns.spec.num_layers) == ("m#full:1,3", 2)
    assert (window_ns.model_id, window_ns.spec.num_layers) == ("m#swa100:0,2", 2)
    seeds = {full_ns.seed, window_ns.seed, Namespaces("m", SPEC).get("t", "").seed}
    assert len(seeds) == 3


def test_a_state_group_makes_the_plan_inert() -> None:
    mamba = MambaSpec(BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    plan = layer_plan(config(([0, 2], mamba), ([1, 3], full())))
    assert plan is not None and plan.inert
    assert plan.unmovable == ("MambaSpec",)


def test_first_live_token_is_vllms_skipped_tokens_rounded_down_to_a_block() -> None:
    swa = LayerSet((0,), 100)
    assert first_live_token(699, swa, BLOCK) == 576  # skips 600 tokens: 18 whole blocks
    assert first_live_token(512, swa, BLOCK) == 384  # skips 413: 12 blocks
    assert first_live_token(99, swa, BLOCK) == 0
    assert first_live_token(699, LayerSet((0,)), BLOCK) == 0  # full attention keeps all
    assert first_live_token(699, LayerSet((0,), 100, extra_retained=64), BLOCK) == 512


def test_a_consumer_stops_where_every_window_is_held() -> None:
    plan = hybrid()
    cap, local = 699, 0
    assert usable_stop(cap, local, 256, plan, [[], [True, True, True]]) == 699
    # the last chunk's window is missing: 512 needs [384, 512), chunk 1
    assert usable_stop(cap, local, 256, plan, [[], [True, True, False]]) == 512
    # only the last one is held (chunked prefill): nothing before the end is usable
    assert usable_stop(511, local, 256, plan, [[], [False, False, True]]) == 0
    assert usable_stop(cap, local, 256, plan, [[], [False, False, True]]) == 699
    # nothing known of the window set: it holds nothing
    assert usable_stop(cap, local, 256, plan, []) == 0


def test_tokens_below_vllms_own_hit_need_no_window() -> None:
    plan = hybrid()
    # vLLM's prefix cache has 640 tokens: the window before 699 starts at 576 < 640
    assert usable_stop(699, 640, 256, plan, [[], [False, False, True]]) == 699
    assert usable_stop(699, 699, 256, plan, [[], [True, True, True]]) == 699


def test_live_blocks_start_after_the_null_entries_of_every_group_of_the_set() -> None:
    plan = hybrid()
    null = 0
    groups = [[0] * 12 + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], list(range(20, 42))]
    assert live_start(plan, 1, groups, null) == 12 * BLOCK
    assert live_start(plan, 0, groups, null) == 0
    assert all_live(plan, 1, groups, null, 512, 699)
    assert not all_live(plan, 1, groups, null, 256, 512)  # blocks 8..11 were freed
    assert all_live(plan, 0, groups, null, 0, 699)
    assert not all_live(plan, 0, groups, null, 0, 800)  # no block for tokens past 703


def test_groups_of_one_window_form_one_set_each_layer_with_its_own_table() -> None:
    """Gemma-3 style: vLLM splits the sliding-window layers into equal groups, one table
    each; they are one set (one object per chunk), each layer placed in its own group."""
    plan = layer_plan(config(([0, 2], window()), ([3, 4], window()), ([1, 5], full())))
    assert plan is not None
    assert plan.sets == (LayerSet((1, 5)), LayerSet((0, 2, 3, 4), 100))
    assert plan.set_groups == ((2,), (0, 1))
    assert plan.place[name(3)] == Placement(1, 2, 1)
    # the set's tokens are live where every group of it has a live block
    groups = [[0, 0, 0, 7], [0, 0, 8, 9], [1, 2, 3, 4]]
    assert live_start(plan, 1, groups, 0) == 3 * BLOCK
    assert not all_live(plan, 1, groups, 0, 2 * BLOCK, 3 * BLOCK)


def test_windows_of_two_sizes_are_two_sets_smallest_first() -> None:
    plan = layer_plan(config(([0], window(512)), ([1], window(64)), ([2, 3], full())))
    assert plan is not None
    assert [s.window for s in plan.sets] == [None, 64, 512]
