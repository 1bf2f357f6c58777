"""Every HTTP endpoint of a real daemon (``kvfabric serve`` as a subprocess), next to the
socket clients that fill its store.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.client import Client
from kvfabric.errors import KVFabricError, NotFoundError
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.messages import encode_namespace
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("api-model", SPEC, tenant_salt="acme")
CT = SPEC.chunk_tokens
# DRAM holds 8 chunks of 16 KiB: a longer prompt spills its oldest chunks to SSD. Watermarks
# at 1: only puts move chunks (make room), never the background pass between two of a
# test's calls (on a loaded host it demoted a chunk between a lookup and its check)
SETTINGS = [
    "store.tiers.dram.capacity=128KiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=32MiB",
    "node_id=api-node-1",
    "store.high_watermark=1.0",
    "store.low_watermark=1.0",
]


@pytest.fixture
def daemon(start_daemon):
    return start_daemon(*SETTINGS)


@pytest.fixture
def http(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def shared(start_module_daemon):
    return start_module_daemon("api-shared", *SETTINGS)


@pytest.fixture
def shared_http(shared):
    with httpx.Client(base_url=shared.http_url, timeout=60) as client:
        yield client


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, SPEC.chunk_bytes, dtype=np.uint8
    )


def put_prompt(client: Client, n_chunks: int, start: int = 0) -> list[bytes]:
    refs = chunk_hashes(NS, list(range(start, start + n_chunks * CT)))
    for ref in refs:
        assert client.put(NS, ref.key, payload(ref.key), parent=ref.parent)
    return [r.key for r in refs]


def samples(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(snapshot: dict, name: str, **labels: str) -> float:
    return snapshot.get((name, frozenset(labels.items())), 0.0)


def lookup_body(ns: Namespace = NS, **form) -> dict:
    return {"namespace": encode_namespace(ns), **form}


# ---------------------------------------------------------------------- probes


def test_healthz(daemon, http) -> None:
    response = http.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["node_id"] == "api-node-1" == daemon.info["node_id"]
    assert 0 <= body["uptime_s"] < 600
    time.sleep(0.2)
    assert http.get("/healthz").json()["uptime_s"] > body["uptime_s"]


def test_readyz_is_200_while_serving_and_503_while_draining(daemon, http) -> None:
    response = http.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "node_id": "api-node-1"}
    # an in-flight request keeps the control server draining for a while after SIGTERM:
    # during that window the daemon must report not ready, while HTTP still answers
    client = Client(daemon.socket, reconnect=False)
    key = os.urandom(16)
    writer = client.reserve(NS, key)
    reader = Client(daemon.socket, reconnect=False)
    pin = reader.get(NS, key)
    waiting = threading.Thread(target=lambda: _ignore(pin.wait_layer, 0, 3.0))
    waiting.start()
    time.sleep(0.3)
    daemon.proc.terminate()
    seen = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and 503 not in seen:
        try:
            seen.add(http.get("/readyz").status_code)
        except httpx.HTTPError:
            break
        time.sleep(0.02)
    waiting.join(20)
    assert 503 in seen, seen
    assert daemon.proc.wait(30) == 0
    del writer
    client.close()
    reader.close()


def _ignore(fn, *args) -> None:
    """Run a wait that the shutdown ends one way or another."""
    with contextlib.suppress(KVFabricError):
        fn(*args)


# ---------------------------------------------------------------------- metrics


def test_metrics_token_counters_move_by_exact_amounts(daemon, http) -> None:
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 12)  # 12 chunks of 16 KiB into 8 chunks of DRAM
        http.post("/v1/admin/flush").raise_for_status()
        before = samples(http)

        # one lookup through the socket: 12 stored chunks + 2 unknown ones + 5 loose tokens
        tokens = list(range(14 * CT + 5))
        hit = client.lookup(NS, tokens)
        assert (hit.requested_chunks, hit.matched_chunks, hit.matched_tokens) == (14, 12, 12 * CT)
        assert set(hit.tier_tokens) == {"dram", "ssd"}, hit.tier_tokens  # spilled
        assert sum(hit.tier_tokens.values()) == 12 * CT
        after_socket = samples(http)

        # one through HTTP, by chunk hashes: the first 10 chunks + one unknown hash
        body = lookup_body(chunk_hashes=[k.hex() for k in keys[:10]] + ["ab" * 16])
        response = http.post("/v1/lookup", json=body)
        assert response.status_code == 200, response.text
        http_hit = response.json()
        after_http = samples(http)

    t = "acme"
    assert (
        value(after_socket, "kvfabric_lookups_total", tenant=t)
        - value(before, "kvfabric_lookups_total", tenant=t)
        == 1
    )
    assert (
        value(after_socket, "kvfabric_lookup_tokens_total", tenant=t)
        - value(before, "kvfabric_lookup_tokens_total", tenant=t)
        == 14 * CT
    )
    assert (
        value(after_socket, "kvfabric_miss_tokens_total", tenant=t)
        - value(before, "kvfabric_miss_tokens_total", tenant=t)
        == 2 * CT
    )
    for tier, tokens in hit.tier_tokens.items():
        assert (
            value(after_socket, "kvfabric_hit_tokens_total", tier=tier, tenant=t)
            - value(before, "kvfabric_hit_tokens_total", tier=tier, tenant=t)
            == tokens
        )

    assert http_hit["requested_chunks"] == 11 and http_hit["matched_chunks"] == 10
    assert http_hit["matched_tokens"] == 10 * CT and http_hit["requested_tokens"] is None
    assert sum(http_hit["tiers"].values()) == 10 * CT
    assert (
        value(after_http, "kvfabric_lookups_total", tenant=t)
        - value(after_socket, "kvfabric_lookups_total", tenant=t)
        == 1
    )
    assert (
        value(after_http, "kvfabric_lookup_tokens_total", tenant=t)
        - value(after_socket, "kvfabric_lookup_tokens_total", tenant=t)
        == 11 * CT
    )
    assert (
        value(after_http, "kvfabric_miss_tokens_total", tenant=t)
        - value(after_socket, "kvfabric_miss_tokens_total", tenant=t)
        == CT
    )
    for tier in ("dram", "ssd"):
        assert value(after_http, "kvfabric_hit_tokens_total", tier=tier, tenant=t) - value(
            after_socket, "kvfabric_hit_tokens_total", tier=tier, tenant=t
        ) == http_hit["tiers"].get(tier, 0)
    # the request histograms saw one lookup on each plane
    for plane, snap_before, snap_after in (
        ("control", before, after_socket),
        ("http", after_socket, after_http),
    ):
        count = "kvfabric_request_duration_seconds_count"
        assert (
            value(snap_after, count, plane=plane, op="lookup")
            - value(snap_before, count, plane=plane, op="lookup")
            == 1
        )
    # store-side gauges agree with the stats endpoint
    stats = http.get("/v1/stats").json()
    for tier in stats["tiers"]:
        assert value(after_http, "kvfabric_tier_objects", tier=tier["name"]) == tier["objects"]
        assert (
            value(after_http, "kvfabric_tier_capacity_bytes", tier=tier["name"])
            == tier["capacity_bytes"]
        )
    assert value(after_http, "kvfabric_store_commits_total") == 12


def test_engine_traffic_is_counted_by_the_engine_each_client_serves(shared, shared_http) -> None:
    before = samples(shared_http)
    with (
        Client(shared.socket, engine="vllm") as vllm,
        Client(shared.socket, engine="sglang") as sglang,
    ):
        keys = put_prompt(vllm, 3, start=50_000)  # 3 chunks written by "vllm"
        assert sglang.lookup(NS, keys=[*keys, b"\x07" * 16]).matched_chunks == 3
        sglang.release_many(sglang.get_many(NS, keys[:2]))  # 2 chunks read by "sglang"
    after = samples(shared_http)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert (
        moved("kvfabric_engine_bytes_total", engine="vllm", direction="written")
        == 3 * SPEC.chunk_bytes
    )
    assert (
        moved("kvfabric_engine_bytes_total", engine="sglang", direction="read")
        == 2 * SPEC.chunk_bytes
    )
    assert moved("kvfabric_engine_bytes_total", engine="sglang", direction="written") == 0
    assert moved("kvfabric_engine_lookup_tokens_total", engine="sglang") == 4 * CT
    assert moved("kvfabric_engine_hit_tokens_total", engine="sglang") == 3 * CT


def test_metrics_parse_and_carry_every_documented_family(shared_http) -> None:
    text = shared_http.get("/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    expected = {
        "kvfabric_sessions": "gauge",
        "kvfabric_lookups": "counter",
        "kvfabric_lookup_tokens": "counter",
        "kvfabric_hit_tokens": "counter",
        "kvfabric_miss_tokens": "counter",
        "kvfabric_request_duration_seconds": "histogram",
        "kvfabric_store_operation_duration_seconds": "histogram",
        "kvfabric_tier_capacity_bytes": "gauge",
        "kvfabric_tier_used_bytes": "gauge",
        "kvfabric_tier_objects": "gauge",
        "kvfabric_tier_evictions": "counter",
        "kvfabric_store_commits": "counter",
        "kvfabric_store_leases_expired": "counter",
        "kvfabric_engine_lookup_tokens": "counter",
        "kvfabric_engine_hit_tokens": "counter",
        "kvfabric_engine_bytes": "counter",
    }
    for name, kind in expected.items():
        assert families.get(name) == kind, (name, families.get(name))


def test_sessions_gauge_follows_connections(daemon, http) -> None:
    base = value(samples(http), "kvfabric_sessions")
    clients = [Client(daemon.socket) for _ in range(3)]
    try:
        assert value(samples(http), "kvfabric_sessions") == base + 3
        assert http.get("/v1/stats").json()["sessions"] == base + 3
    finally:
        for client in clients:
            client.close()
    deadline = time.monotonic() + 5
    while value(samples(http), "kvfabric_sessions") != base:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ---------------------------------------------------------------------- lookup


def test_lookup_by_token_ids_per_tier(daemon, http) -> None:
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 12)
    http.post("/v1/admin/flush").raise_for_status()
    token_ids = list(range(12 * CT + 7))  # 12 full chunks and a partial one (never matched)
    response = http.post("/v1/lookup", json=lookup_body(token_ids=token_ids))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body == {
        "matched_tokens": 12 * CT,
        "matched_chunks": 12,
        "requested_chunks": 12,
        "requested_tokens": 12 * CT + 7,
        "chunk_tokens": CT,
        "tiers": body["tiers"],
    }
    assert set(body["tiers"]) == {"dram", "ssd"} and sum(body["tiers"].values()) == 12 * CT
    # the per-tier split agrees with chunk-by-chunk lookups of the same keys
    per_key = {}
    for key in keys:
        one = http.post("/v1/lookup", json=lookup_body(chunk_hashes=[key.hex()])).json()
        (tier,) = one["tiers"]
        per_key[tier] = per_key.get(tier, 0) + one["matched_tokens"]
    assert per_key == body["tiers"]
    # the prefix stops at the first gap
    with Client(daemon.socket) as client:
        assert client.delete(NS, keys[5]) is True
    body = http.post("/v1/lookup", json=lookup_body(token_ids=token_ids)).json()
    assert (body["matched_chunks"], body["matched_tokens"]) == (5, 5 * CT)
    # and another namespace sees nothing
    other = Namespace("api-model", SPEC, tenant_salt="someone-else")
    body = http.post("/v1/lookup", json=lookup_body(other, token_ids=token_ids)).json()
    assert body["matched_tokens"] == 0 and body["tiers"] == {}


def test_lookup_by_chunk_hashes(daemon, http) -> None:
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 4, start=777)
    body = http.post("/v1/lookup", json=lookup_body(chunk_hashes=[k.hex() for k in keys])).json()
    assert (body["matched_chunks"], body["requested_chunks"], body["requested_tokens"]) == (
        4,
        4,
        None,
    )
    assert body["tiers"] == {"dram": 4 * CT}
    upper = [k.hex().upper() for k in keys[:2]]
    assert (
        http.post("/v1/lookup", json=lookup_body(chunk_hashes=upper)).json()["matched_chunks"] == 2
    )
    body = http.post("/v1/lookup", json=lookup_body(chunk_hashes=[])).json()
    assert (body["matched_chunks"], body["requested_chunks"]) == (0, 0)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"namespace": encode_namespace(NS)},
        lookup_body(token_ids=[1], chunk_hashes=["00" * 16]),
        lookup_body(token_ids=[1 << 31]),
        lookup_body(token_ids=["1"]),
        lookup_body(token_ids=[1.5]),
        lookup_body(chunk_hashes=["00" * 15]),
        lookup_body(chunk_hashes=["zz" * 16]),
        lookup_body(chunk_hashes=[1]),
        {**lookup_body(token_ids=[1]), "extra": 1},
        {
            "namespace": {**encode_namespace(NS), "spec": {**SPEC.to_dict(), "num_layers": 0}},
            "token_ids": [1],
        },
        {
            "namespace": {**encode_namespace(NS), "spec": {**SPEC.to_dict(), "kind": "mla"}},
            "token_ids": [1],
        },
        {"namespace": {**encode_namespace(NS), "model": ""}, "token_ids": [1]},
        [1, 2, 3],
    ],
)
def test_bad_lookup_bodies_are_422_bad_request(shared_http, body) -> None:
    response = shared_http.post("/v1/lookup", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["kind"] == "bad_request"
    assert shared_http.get("/healthz").status_code == 200


def test_malformed_json_is_422(shared_http) -> None:
    response = shared_http.post(
        "/v1/lookup", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["kind"] == "bad_request"


# ---------------------------------------------------------------------- stats


def test_stats(daemon, http) -> None:
    with Client(daemon.socket) as client:
        put_prompt(client, 12)
        client.lookup(NS, list(range(3 * CT)))
        http.post("/v1/admin/flush").raise_for_status()
        response = http.get("/v1/stats")
        assert response.status_code == 200
        stats = response.json()
        assert stats["node_id"] == "api-node-1" and stats["ready"] is True
        assert stats["sessions"] >= 1 and 0 <= stats["uptime_s"] < 600
        tiers = {t["name"]: t for t in stats["tiers"]}
        assert list(tiers) == ["dram", "ssd"]
        assert tiers["dram"]["kind"] == "dram" and tiers["ssd"]["kind"] == "ssd"
        assert tiers["dram"]["capacity_bytes"] == 128 << 10
        assert tiers["ssd"]["capacity_bytes"] == 32 << 20
        assert tiers["dram"]["used_bytes"] == tiers["dram"]["objects"] * SPEC.chunk_bytes
        assert tiers["dram"]["utilisation"] == pytest.approx(
            tiers["dram"]["used_bytes"] / tiers["dram"]["capacity_bytes"]
        )
        assert tiers["ssd"]["objects"] >= 4 and tiers["ssd"]["used_bytes"] > 0
        assert tiers["dram"]["demotions"] >= tiers["ssd"]["objects"]
        totals = stats["totals"]
        assert totals["objects"] == 12 == sum(t["objects"] for t in stats["tiers"])
        assert totals["puts"] == 12 and totals["lookups"] == 1
        assert totals["lookup_tokens"] == 3 * CT and totals["hit_tokens"] == 3 * CT
        assert totals["miss_tokens"] == 0 and totals["hit_rate"] == 1.0
        assert totals["evictions"] == 0
        assert stats["namespaces"] == [
            {
                "model": "api-model",
                "tenant": "acme",
                "lookups": 1,
                "lookup_tokens": 3 * CT,
                "hit_tokens": 3 * CT,
            }
        ]
        # and the socket's view is the same store
        assert client.stats()["objects"] == 12


# ---------------------------------------------------------------------- admin


def _tiers(http: httpx.Client) -> dict[str, dict]:
    return {t["name"]: t for t in http.get("/v1/stats").json()["tiers"]}


def evict(http: httpx.Client, **body) -> int:
    response = http.post("/v1/admin/evict", json=body)
    assert response.status_code == 200, response.text
    return response.json()["evicted"]


def test_admin_evict_removes_objects_and_counts_them(daemon, http) -> None:
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 12)  # one chain, spread over DRAM and SSD
        http.post("/v1/admin/flush").raise_for_status()
        tier_of = {k: next(iter(client.lookup(NS, keys=[k]).tier_tokens)) for k in keys}
        count = {t: list(tier_of.values()).count(t) for t in ("dram", "ssd")}
        assert count["dram"] >= 1 and count["ssd"] >= 1
        other = "ssd" if tier_of[keys[-1]] == "dram" else "dram"

        # by bytes: one chunk's worth evicts exactly one: the chain's tail, its only leaf
        assert evict(http, tier=tier_of[keys[-1]], bytes=1) == 1
        assert client.contains(NS, keys[-2:]) == [True, False]
        # a pinned leaf stays, and so does the chain above it
        pin = client.get(NS, keys[-2])
        assert evict(http, tier="dram") == 0 and evict(http, tier="ssd") == 0
        assert client.contains(NS, keys[:-1]) == [True] * 11
        assert pin.to_bytes() == payload(keys[-2]).tobytes()
        pin.release()
        # tier by tier, the rest of the chain goes, tail first
        evicted, rounds = 1, 0
        while evicted < 12 and rounds < 30:
            for tier in (other, tier_of[keys[-1]]):
                evicted += evict(http, tier=tier)
            rounds += 1
        assert evicted == 12
        assert client.contains(NS, keys) == [False] * 12
        with pytest.raises(NotFoundError):
            client.get(NS, keys[0])

    # (reading the pinned chunk may have promoted it, and moved others: count per tier
    # from the store's own counters, which must add up and agree with /metrics)
    stats = http.get("/v1/stats").json()
    tiers = {t["name"]: t for t in stats["tiers"]}
    assert tiers["dram"]["evictions"] >= 1 and tiers["ssd"]["evictions"] >= 1
    assert tiers["dram"]["evictions"] + tiers["ssd"]["evictions"] == 12
    assert stats["totals"]["evictions"] == 12 and stats["totals"]["objects"] == 0
    assert tiers["dram"]["used_bytes"] == 0
    now = samples(http)
    for tier in ("dram", "ssd"):
        assert value(now, "kvfabric_tier_evictions_total", tier=tier) == tiers[tier]["evictions"]
        assert value(now, "kvfabric_tier_objects", tier=tier) == 0


def test_admin_evict_of_everything_empties_every_tier(daemon, http) -> None:
    """No tier and no byte count: every unpinned object goes, whichever tier holds which
    part of a chain (here the head is on SSD and the tail in DRAM)."""
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 12)
        http.post("/v1/admin/flush").raise_for_status()
        assert set(client.lookup(NS, keys=keys).tier_tokens) == {"dram", "ssd"}
        assert evict(http) == 12
        assert client.contains(NS, keys) == [False] * 12
    stats = http.get("/v1/stats").json()
    assert stats["totals"]["objects"] == 0 and stats["totals"]["evictions"] == 12


@pytest.mark.parametrize(
    "body,status",
    [
        ({"tier": "nope"}, 404),
        ({"bytes": 0}, 422),
        ({"bytes": -5}, 422),
        ({"bytes": "1"}, 422),
        ({"tier": 3}, 422),
        ({"extra": 1}, 422),
        ([], 422),
    ],
)
def test_admin_evict_refuses_bad_bodies(shared, shared_http, body, status) -> None:
    with Client(shared.socket) as client:
        keys = put_prompt(client, 2, start=int.from_bytes(os.urandom(3), "little") * 64)
        response = shared_http.post("/v1/admin/evict", json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["kind"] in ("bad_request", "not_found")
        assert client.contains(NS, keys) == [True, True]  # nothing evicted


def test_admin_flush_waits_for_ssd_writes(daemon, http) -> None:
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 24)  # three times DRAM: demotions queue up on the SSD
        response = http.post("/v1/admin/flush")
        assert response.status_code == 200, response.text
        assert response.json() == {"flushed": True}
        stats = http.get("/v1/stats").json()
        tiers = {t["name"]: t for t in stats["tiers"]}
        assert tiers["ssd"]["objects"] >= 16
        assert tiers["ssd"]["bytes_in"] == tiers["ssd"]["objects"] * SPEC.chunk_bytes
        assert stats["totals"]["objects"] == 24
        # flushed records survive a restart
        on_ssd = [k for k in keys if client.lookup(NS, keys=[k]).tier_tokens == {"ssd": CT}]
    assert len(on_ssd) == tiers["ssd"]["objects"]
    assert daemon.stop() == 0


def test_unknown_paths_and_methods(shared_http) -> None:
    assert shared_http.get("/v1/nope").status_code == 404
    assert shared_http.get("/v1/lookup").status_code == 405
    assert shared_http.delete("/v1/stats").status_code == 405
