"""measure_opcosts against a real redis-server: every cost is measured (positive), the sizes
fit the key layout of kvfabric.cluster.redis_index, and the server is left as it was."""

from __future__ import annotations

import pytest
import redis
from child_process import free_port
from redis_process import RedisServer

from kvfabric.errors import SpecError, UnavailableError
from kvfabric.planning.opcosts import measure_opcosts
from kvfabric.planning.scale import plan_scale
from kvfabric.planning.scale_inputs import REFERENCE_10K, OpCosts

NODE_ID_CHARS = 24
CHUNK_TOKENS = 256
RUN_CHUNKS = 8
OWNER = NODE_ID_CHARS + len("|1|dram")  # one 'node|epoch|tier' of an owners list
META = 16 + 4  # parent key + u32 token count
KEY = 16


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[OpCosts, list[bytes]]:
    """Costs measured on a server of their own (a small run), and the keys left behind."""
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as server:
        costs = measure_opcosts(
            server.url,
            live_nodes=130,
            chains=8,
            chain_chunks=16,
            run_chunks=RUN_CHUNKS,
            lookups=100,
            chunk_tokens=CHUNK_TOKENS,
            node_id_chars=NODE_ID_CHARS,
            host="test",
        )
        client = redis.Redis.from_url(server.url)
        left = list(client.scan_iter(match="*"))
        client.close()
    return costs, left


def test_every_cost_is_measured(measured: tuple[OpCosts, list[bytes]]) -> None:
    costs, _ = measured
    for name in (
        "store_server_s",
        "remove_server_s",
        "xadd_server_s",
        "stored_event_read_server_s",
        "removed_event_read_server_s",
        "heartbeat_server_s",
        "nodes_server_s_per_node",
        "event_encode_s",
        "event_decode_s",
        "consumer_cpu_s_per_stored",
        "consumer_cpu_s_per_removed",
        "nodes_client_cpu_s_per_node",
        "register_client_s",
    ):
        assert getattr(costs, name) > 0, name
    # a lookup's costs grow with the namespace's live hash, which it reads whole
    assert costs.lookup_server_s.at(16, 130) > 0
    assert costs.lookup_server_s.per_live_node > 0
    assert costs.lookup_client_cpu_s.per_live_node > 0
    assert costs.host.startswith("test; ")


def test_round_trips_and_events_follow_the_layout(measured: tuple[OpCosts, list[bytes]]) -> None:
    costs, _ = measured
    assert costs.commands_per_lookup == 1  # one script: one round trip
    # a run's batch: one update script and one XADD (the namespace's SADD once per node)
    assert 2 <= costs.commands_per_publish_batch <= 2.5
    assert costs.events_per_chunk == 1 / RUN_CHUNKS  # one event per chain run


def test_sizes_fit_the_key_layout(measured: tuple[OpCosts, list[bytes]]) -> None:
    costs, _ = measured
    # a chunk is a field of the owners hash (key -> one owner) and of the meta hash (key ->
    # parent + count); Redis adds per-field overhead (dict entry, string headers, buckets)
    payload = 2 * KEY + OWNER + META
    assert payload <= costs.bytes_per_entry <= payload + 320
    # a second copy appends ',node|epoch|tier' to the value (allocator classes round it)
    assert 0 < costs.bytes_per_extra_copy <= 4 * (1 + OWNER)
    # a live field: node id -> 'epoch:deadline in ms'
    assert NODE_ID_CHARS + len("1:1700000000000") <= costs.bytes_per_live_field <= 200
    # a stored run carries its chunks' token ids: 4 bytes a token
    tokens = RUN_CHUNKS * 4 * CHUNK_TOKENS
    assert tokens <= costs.stream_bytes_per_stored_event <= 2 * tokens
    assert tokens <= costs.stored_event_read_bytes <= 2 * tokens
    assert KEY <= costs.stream_bytes_per_removed_event < 1024
    # a lookup answers each chunk's owner list (two copies here) and every live field
    assert costs.lookup_reply_bytes.per_chunk >= 2 * OWNER
    assert NODE_ID_CHARS <= costs.lookup_reply_bytes.per_live_node <= 200
    # a follower keeps each remote chunk's token ids
    assert costs.remote_inventory_bytes_per_chunk >= 4 * CHUNK_TOKENS


def test_the_server_keeps_none_of_the_measurement(measured: tuple[OpCosts, list[bytes]]) -> None:
    _, left = measured
    assert left == []


def test_measured_costs_plan_the_10k_reference(measured: tuple[OpCosts, list[bytes]]) -> None:
    costs, _ = measured
    plan = plan_scale(REFERENCE_10K, costs)
    assert 3 <= plan.shards < 10**9
    assert plan.first_saturation_nodes is not None


def test_a_cluster_url_or_no_server_is_refused() -> None:
    with pytest.raises(SpecError):
        measure_opcosts("redis+cluster://127.0.0.1:7000/0")
    with pytest.raises(UnavailableError):
        measure_opcosts(f"redis://127.0.0.1:{free_port()}/0")
