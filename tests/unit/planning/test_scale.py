"""The capacity plan is arithmetic a reader can redo by hand: entries, bytes, rates and Redis
work follow the layout of kvfabric.cluster.redis_index; shards are the larger of memory and
CPU over a shard's budget; every component reports the node count where it runs out."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvfabric.errors import SpecError
from kvfabric.planning.scale import (
    DAEMON_LOOKUP,
    EVENT_CONSUMERS,
    EVENT_STREAM,
    HOT_NAMESPACE,
    LOOKUP_NETWORK,
    REDIS_MEMORY,
    REDIS_OPS,
    REGISTRY,
    plan_scale,
    saturation_curve,
)
from kvfabric.planning.scale_inputs import (
    REFERENCE_10K,
    LinearCost,
    OpCosts,
    ScaleInputs,
    ShardBudget,
    kv_bytes_per_token,
    kv_bytes_per_token_of,
)
from kvfabric.planning.scale_report import render_curve, render_table
from kvfabric.spec import KVSpec

MiB = 1 << 20
COMPONENTS = {
    REDIS_MEMORY,
    REDIS_OPS,
    HOT_NAMESPACE,
    REGISTRY,
    EVENT_STREAM,
    EVENT_CONSUMERS,
    DAEMON_LOOKUP,
    LOOKUP_NETWORK,
}

# Round costs, of the order measure_opcosts finds, so every expected value below is a
# hand computation.
COSTS = OpCosts(
    commands_per_lookup=1.0,
    commands_per_publish_batch=2.0,
    lookup_server_s=LinearCost(10e-6, per_chunk=1e-6, per_live_node=0.5e-6),
    store_server_s=10e-6,
    remove_server_s=10e-6,
    xadd_server_s=10e-6,
    stored_event_read_server_s=8e-6,  # a run of 8 chunks: 1 us per chunk
    removed_event_read_server_s=1e-6,
    heartbeat_server_s=20e-6,
    nodes_server_s_per_node=2e-6,
    bytes_per_entry=200.0,
    bytes_per_extra_copy=30.0,
    bytes_per_live_field=50.0,
    bytes_per_registered_node=600.0,
    stream_bytes_per_stored_event=8000.0,  # 1000 per chunk
    stream_bytes_per_removed_event=100.0,
    lookup_reply_bytes=LinearCost(40.0, per_chunk=60.0, per_live_node=50.0),
    stored_event_read_bytes=8000.0,
    removed_event_read_bytes=200.0,
    nodes_reply_bytes_per_node=200.0,
    events_per_chunk=0.125,
    event_encode_s=4e-6,
    event_decode_s=7e-6,
    consumer_cpu_s_per_stored=50e-6,
    consumer_cpu_s_per_removed=25e-6,
    remote_inventory_bytes_per_chunk=2000.0,
    lookup_client_cpu_s=LinearCost(50e-6, per_chunk=1e-6, per_live_node=2e-6),
    lookup_client_wall_s=LinearCost(200e-6, per_chunk=1e-6, per_live_node=2e-6),
    nodes_client_cpu_s_per_node=20e-6,
    register_client_s=1e-3,
    run_chunks=8,
)

# 10 nodes, 1 request/s each: 2048-token prompts (8 chunks), half new, 256 output tokens
# stored: 1280 new tokens = 5 chunks per request. 1 MiB chunks, 100 in DRAM, no SSD.
SMALL = ScaleInputs(
    nodes=10,
    requests_per_node_s=1.0,
    prompt_tokens=2048,
    new_token_share=0.5,
    output_tokens=256,
    kv_bytes_per_token=4096,
    dram_bytes_per_node=100 * MiB,
    ssd_bytes_per_node=0,
    copies_per_chunk=2.0,
    max_events=1000,
)


def test_a_small_cluster_by_hand() -> None:
    plan = plan_scale(SMALL, COSTS)
    # 10 nodes x 100 chunks are 1000 owner entries; two copies each: 500 distinct chunks
    assert plan.owner_entries == 1000
    assert plan.index_entries == 500
    # 500 fields of 200 bytes, and 500 second copies of 30 bytes in their owner lists
    assert plan.index_bytes == 500 * 200 + 500 * 30
    assert plan.bytes_per_entry == pytest.approx(230)
    assert plan.live_bytes == 10 * 50  # one namespace: one live field per node
    assert plan.registry_bytes == 10 * 600
    # 10 requests/s x 5 new chunks; one tier: each stored once and removed once
    assert plan.new_chunks_per_s == 50
    assert plan.index_writes_per_s == 100
    # a run of 5 stored chunks is one event (measured: 1/8 per chunk), removals one each
    assert plan.kv_events_per_s == pytest.approx(50 * 0.125 + 50)
    # the stream keeps 1000 events of this mix: 50 chunks/s x 1000 bytes + 50 x 100 bytes
    stream = 1000 * (50 * 1000 + 50 * 100) / 56.25
    assert plan.stream_bytes == pytest.approx(stream)
    assert plan.memory_bytes == pytest.approx(115_000 + 500 + 6000 + stream)
    assert plan.lookups_per_s == 10

    busy = {o.op: o.busy for o in plan.ops}
    assert busy["lookup"] == pytest.approx(10 * (10e-6 + 8 * 1e-6 + 10 * 0.5e-6))
    assert busy["chunk stored"] == pytest.approx(50 * 10e-6)
    assert busy["chunk removed"] == pytest.approx(50 * 10e-6)
    # every 2 s each node renews its namespace lease and its registry lease
    assert busy["lease renewal (namespace)"] == pytest.approx(5 * 20e-6)
    assert busy["lease renewal (registry)"] == pytest.approx(5 * 20e-6)
    # each node lists the 10 nodes every heartbeat (follower) and every 2 s (classes)
    assert busy["node listed"] == pytest.approx(10 * 1.0 * 10 * 2e-6)
    assert busy["event appended"] == pytest.approx(56.25 * 10e-6)
    # every one of the 10 followers reads every event
    assert busy["stored chunk read by a follower"] == pytest.approx(10 * 50 * 1e-6)
    assert busy["removal event read by a follower"] == pytest.approx(10 * 50 * 1e-6)
    assert plan.redis_busy == pytest.approx(sum(busy.values()))
    assert plan.redis_busy == pytest.approx(3192.5e-6)
    # far below one shard: Redis Cluster's minimum of 3 masters
    assert (plan.shards, plan.shards_bound_by) == (3, "minimum")
    assert plan.useful_shards == 3  # one namespace, the registry, the stream


def test_shards_are_the_larger_of_memory_and_ops_and_say_which_binds() -> None:
    memory = plan_scale(SMALL, COSTS, ShardBudget(memory_bytes=100_000, cpu_headroom=0.001))
    assert memory.shards_by_memory == math.ceil(memory.memory_bytes / 100_000) == 11
    assert memory.shards_by_ops == math.ceil(3192.5e-6 / 0.001) == 4
    assert (memory.shards, memory.shards_bound_by) == (11, "memory")

    ops = plan_scale(SMALL, COSTS, ShardBudget(memory_bytes=1e9, cpu_headroom=0.0005))
    assert (ops.shards_by_memory, ops.shards_by_ops) == (1, 7)
    assert (ops.shards, ops.shards_bound_by) == (7, "ops")
    assert any("only 3 slots" in note for note in ops.notes)  # 7 shards, 3 slots


def test_a_component_saturates_at_the_node_count_where_its_load_meets_its_budget() -> None:
    plan = plan_scale(SMALL, COSTS)
    by_name = {s.component: s for s in plan.saturation}
    # a follower applies every node's updates: 5 n stored and 5 n removed chunks a second,
    # 375 us x n of CPU against a quarter core: 0.25 / 375e-6 = 666.7 nodes
    consumers = by_name[EVENT_CONSUMERS]
    assert consumers.resource == "cpu"
    assert consumers.saturates_at_nodes == 667
    assert consumers.utilization == pytest.approx(10 * 375e-6 / 0.25)
    below = plan_scale(replace(SMALL, nodes=666), COSTS)
    at = plan_scale(replace(SMALL, nodes=667), COSTS)
    assert EVENT_CONSUMERS not in below.blocked_by
    assert EVENT_CONSUMERS in at.blocked_by
    # the hot namespace's shard sends n lookups/s of 40 + 60 x 8 + 50 n bytes: quadratic
    # in n, against half of 10 Gbit/s
    n = (-520 + math.sqrt(520**2 + 4 * 50 * 0.625e9)) / (2 * 50)
    assert by_name[LOOKUP_NETWORK].saturates_at_nodes == math.ceil(n)
    # sorted: the first to saturate first
    nodes = [s.saturates_at_nodes for s in plan.saturation]
    assert nodes == sorted(nodes, key=lambda x: math.inf if x is None else x)
    assert plan.first_saturating == plan.saturation[0].component
    assert plan.feasible and not plan.blocked_by


def test_every_load_grows_with_the_node_count() -> None:
    plans = saturation_curve(SMALL, COSTS, (10, 100, 1000, 10_000))
    assert [p.nodes for p in plans] == [10, 100, 1000, 10_000]
    for field in (
        "index_entries",
        "memory_bytes",
        "lookups_per_s",
        "kv_events_per_s",
        "redis_busy",
        "shards",
    ):
        values = [getattr(p, field) for p in plans]
        assert values == sorted(values), field
    assert plans[-1].redis_busy > 100 * plans[1].redis_busy  # fan-outs: faster than linear
    assert len(render_curve(plans).splitlines()) == 5


def test_the_10k_reference_plan_has_a_finite_shard_count_and_names_its_first_bottleneck() -> None:
    plan = plan_scale(REFERENCE_10K, COSTS)
    assert plan.nodes == 10_000
    assert 3 <= plan.shards < 10**9
    assert plan.shards_bound_by in ("memory", "ops")
    assert {s.component for s in plan.saturation} == COMPONENTS
    assert plan.first_saturating in COMPONENTS
    first = plan.first_saturation_nodes
    assert first is not None and first < 10_000
    # one namespace, one stream: no shard count saves the single slots
    assert not plan.feasible
    assert plan.first_saturating in plan.blocked_by
    text = render_table(plan)
    assert f"first to saturate: {plan.first_saturating}" in text
    assert "Redis Cluster shards" in text


def test_bytes_per_token_come_from_the_model_shape() -> None:
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128, bfloat16: K and V, 128 KiB per token
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072
    assert kv_bytes_per_token_of(KVSpec(num_layers=32, num_kv_heads=8, head_dim=128)) == 131072
    assert kv_bytes_per_token(61, 1, 576, 1, planes=1) == 61 * 576  # an MLA latent in fp8


@pytest.mark.parametrize(
    "change",
    [
        {"nodes": 0},
        {"new_token_share": 1.5},
        {"requests_per_node_s": -1.0},
        {"copies_per_chunk": 0.5},
        {"dram_bytes_per_node": 0, "ssd_bytes_per_node": 0},
        {"hot_namespace_share": 0.1},  # below 1 / namespaces
        {"namespaces_per_node": 2},  # more than the namespaces there are
        {"heartbeat_s": 0.0},
    ],
)
def test_inputs_out_of_range_are_refused(change: dict[str, float]) -> None:
    with pytest.raises(SpecError):
        replace(SMALL, **change)


def test_a_budget_out_of_range_is_refused() -> None:
    with pytest.raises(SpecError):
        ShardBudget(cpu_headroom=0.0)
    with pytest.raises(SpecError):
        ShardBudget(min_shards=0)
