"""Two daemons (separate processes) on one real redis-server: inventory publishing and
cluster-wide lookups, through restarts of a node and of Redis itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from cluster_nodes import SMALL_TIERS, cluster_node

from kvfabric.client import Client
from kvfabric.client import requests as client_requests
from kvfabric.errors import ProtocolError
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.messages import Op, encode_namespace
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("cluster-model", SPEC, tenant_salt="t1")


def node_settings(redis_url: str, node_id: str, lease_ttl_s: float = 10) -> list[str]:
    return cluster_node(redis_url, node_id, "cluster.hardware_class=test", lease_ttl_s=lease_ttl_s)


def put_chain(socket: str, n_chunks: int, start: int = 0) -> list[bytes]:
    refs = chunk_hashes(NS, list(range(start, start + n_chunks * SPEC.chunk_tokens)))
    with Client(socket) as client:
        for ref in refs:
            data = np.full(SPEC.chunk_bytes, ref.key[0], dtype=np.uint8)
            assert client.put(NS, ref.key, data, parent=ref.parent)
    return [r.key for r in refs]


def http_lookup(daemon: Any, keys: list[bytes]) -> dict[str, Any]:
    body = {
        "namespace": encode_namespace(NS),
        "chunk_hashes": [k.hex() for k in keys],
        "scope": "cluster",
    }
    response = httpx.post(f"{daemon.http_url}/v1/lookup", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def control_lookup(daemon: Any, keys: list[bytes]) -> dict[str, Any]:
    with Client(daemon.socket) as client:
        return client._call(
            Op.LOOKUP, {**client_requests.lookup_args(NS, None, keys), "scope": "cluster"}
        )


def holders(answer: dict[str, Any]) -> dict[str, tuple[int, dict[str, int]]]:
    return {n["node_id"]: (n["chunks"], n["tier_chunks"]) for n in answer["nodes"]}


def epoch_of(answer: dict[str, Any], node_id: str) -> int:
    return next(n["epoch"] for n in answer["nodes"] if n["node_id"] == node_id)


def wait_for(
    probe: Callable[[], Any], predicate: Callable[[Any], bool], timeout: float = 10.0
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"condition not reached; last value {value!r}"
        time.sleep(0.05)


def test_puts_deletes_and_evictions_on_a_show_in_lookups_on_b(redis_server, start_daemon) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a"))
    b = start_daemon(*node_settings(redis_server.url, "node-b"))
    keys = put_chain(a.socket, 4)
    seen = wait_for(lambda: http_lookup(b, keys), lambda r: "node-a" in holders(r))
    assert holders(seen) == {"node-a": (4, {"dram": 4})}
    assert seen["stale"] is False
    assert seen["matched_chunks"] == 0  # B's local fields are untouched: B holds nothing
    on_control = control_lookup(b, keys)  # the control op gives the same cluster view
    assert holders(on_control) == holders(seen) and on_control["stale"] is False
    # routers weigh nodes by their declared hardware class
    assert [n["hardware_class"] for n in seen["nodes"] + on_control["nodes"]] == ["test"] * 2
    assert on_control["chunks"] == 0
    with Client(b.socket) as client:  # the default, local scope: no cluster fields
        local = client._call(Op.LOOKUP, client_requests.lookup_args(NS, None, keys))
    assert "nodes" not in local and "stale" not in local

    with Client(a.socket) as client:
        assert client.delete(NS, keys[3])
    wait_for(lambda: http_lookup(b, keys), lambda r: holders(r) == {"node-a": (3, {"dram": 3})})
    evicted = httpx.post(f"{a.http_url}/v1/admin/evict", json={}, timeout=10)
    assert evicted.status_code == 200, evicted.text
    wait_for(lambda: http_lookup(b, keys), lambda r: holders(r) == {})


def test_a_restarted_node_hides_its_old_entries_and_republishes_its_ssd(
    redis_server, start_daemon
) -> None:
    settings = node_settings(redis_server.url, "node-a")
    a = start_daemon(*settings)
    b = start_daemon(*node_settings(redis_server.url, "node-b"))
    volatile = put_chain(a.socket, 3)
    first = wait_for(lambda: http_lookup(b, volatile), lambda r: "node-a" in holders(r))
    a.kill()  # no goodbye: its lease (10 s) is still live and its DRAM copies are gone
    a.start()
    # the new epoch hides the old entries at once, long before the old lease would lapse
    assert "node-a" not in holders(http_lookup(b, volatile))

    durable = put_chain(a.socket, 3, start=1000)
    second = wait_for(lambda: http_lookup(b, durable), lambda r: "node-a" in holders(r))
    assert holders(second)["node-a"] == (3, {"dram": 3})
    assert a.stop() == 0  # persist_on_close (the default) writes DRAM to SSD
    a.start()
    third = wait_for(
        lambda: http_lookup(b, durable), lambda r: holders(r).get("node-a") == (3, {"ssd": 3})
    )
    assert epoch_of(first, "node-a") < epoch_of(second, "node-a") < epoch_of(third, "node-a")
    assert "node-a" not in holders(http_lookup(b, volatile))


def test_redis_outage_keeps_a_serving_and_it_republishes_when_redis_returns(
    redis_server, start_daemon
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a"))
    b = start_daemon(*node_settings(redis_server.url, "node-b"))
    before = put_chain(a.socket, 2)
    wait_for(lambda: http_lookup(b, before), lambda r: "node-a" in holders(r))

    redis_server.kill()
    during = put_chain(a.socket, 3, start=500)  # local puts go on
    with Client(a.socket) as client:
        assert client.lookup(NS, keys=during).matched_chunks == 3
        with client.get(NS, during[2]) as reader:
            assert reader.to_bytes()[:1] == bytes([during[2][0]])
    started = time.monotonic()
    answer = control_lookup(a, during)
    assert time.monotonic() - started < 3  # fails fast, never hangs
    assert answer["stale"] is True and answer["chunks"] == 3
    assert holders(answer) == {"node-a": (3, {"dram": 3})}  # local-only view
    over_http = http_lookup(a, during)
    assert over_http["stale"] is True and holders(over_http) == holders(answer)
    assert http_lookup(b, before)["stale"] is True

    redis_server.start()  # same port, empty: A must republish by itself
    for keys in (before, during):
        seen = wait_for(
            lambda chain=keys: http_lookup(b, chain),
            lambda r: "node-a" in holders(r) and not r["stale"],
            timeout=15,
        )
        assert holders(seen)["node-a"] == (len(keys), {"dram": len(keys)})
    wait_for(lambda: control_lookup(a, during), lambda r: r["stale"] is False)


def test_the_embedded_index_answers_cluster_lookups_with_this_node_alone(start_daemon) -> None:
    a = start_daemon(*SMALL_TIERS, "node_id=solo")  # cluster.index defaults to embedded
    keys = put_chain(a.socket, 3)
    answer = wait_for(lambda: http_lookup(a, keys), lambda r: "solo" in holders(r))
    assert holders(answer) == {"solo": (3, {"dram": 3})} and answer["stale"] is False
    assert answer["matched_chunks"] == 3  # the global view equals the local one
    assert holders(control_lookup(a, keys[:2])) == {"solo": (2, {"dram": 2})}
    with Client(a.socket) as client, pytest.raises(ProtocolError, match="scope"):
        client._call(Op.LOOKUP, {**client_requests.lookup_args(NS, None, keys), "scope": "galaxy"})
    body = {"namespace": encode_namespace(NS), "chunk_hashes": [keys[0].hex()], "scope": "galaxy"}
    assert httpx.post(f"{a.http_url}/v1/lookup", json=body, timeout=10).status_code == 422


def test_a_node_started_while_redis_is_down_joins_once_it_is_up(redis_server, start_daemon) -> None:
    redis_server.kill()
    a = start_daemon(*node_settings(redis_server.url, "node-a"))  # starts all the same
    keys = put_chain(a.socket, 2)
    answer = control_lookup(a, keys)
    assert answer["stale"] is True and holders(answer) == {"node-a": (2, {"dram": 2})}
    redis_server.start()
    b = start_daemon(*node_settings(redis_server.url, "node-b"))
    seen = wait_for(
        lambda: http_lookup(b, keys),
        lambda r: "node-a" in holders(r) and not r["stale"],
        timeout=15,
    )
    assert holders(seen)["node-a"] == (2, {"dram": 2})
