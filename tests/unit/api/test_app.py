"""The HTTP API against a real TieredStore: endpoints, auth, bad bodies, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.api.app import create_app
from kvfabric.api.metrics import Metrics
from kvfabric.config import AuthConfig, DaemonConfig
from kvfabric.errors import DeadlineExceededError, KVFabricError, SpecError, UnavailableError
from kvfabric.hashing import chunk_hashes, chunk_keys
from kvfabric.protocol.messages import MAX_KEYS, MAX_TOKENS
from kvfabric.server.instrumented import InstrumentedStore
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import LookupResult, StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
CT = SPEC.chunk_tokens
CHUNK = SPEC.chunk_bytes
ACME = Namespace("tiny", SPEC, tenant_salt="acme")
ADMIN_TOKEN, ACME_TOKEN = "admin-secret", "acme-secret"
AUTH = AuthConfig(token=ADMIN_TOKEN, tenants={ACME_TOKEN: "acme", "globex-secret": "globex"})


@dataclass
class FakeDaemon:
    config: DaemonConfig
    store: InstrumentedStore
    metrics: Metrics
    node_id: str = "node-a"
    ready: bool = True
    started_at: float = field(default_factory=time.time)
    session_count: int = 0
    cluster: None = None  # no global index: cluster-scope lookups are refused


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


ADMIN, TENANT = bearer(ADMIN_TOKEN), bearer(ACME_TOKEN)


def ns_body(tenant: str = "acme", **spec: Any) -> dict[str, Any]:
    return {"model": "tiny", "spec": {**SPEC.to_dict(), **spec}, "tenant": tenant, "lora": ""}


def prompt(n_tokens: int) -> list[int]:
    return list(range(500, 500 + n_tokens))


def make_daemon(tmp_path: Path, auth: AuthConfig = AUTH, *tiers: TierConfig) -> FakeDaemon:
    tiers = tiers or (TierConfig(TierKind.DRAM, 16 * CHUNK, page_size=4096),)
    store = TieredStore(StoreConfig(data_dir=str(tmp_path), tiers=tiers), maintenance=False)
    metrics = Metrics(store)
    return FakeDaemon(DaemonConfig(auth=auth), InstrumentedStore(store, metrics), metrics)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    d = make_daemon(tmp_path)
    yield d
    d.store.store.close()


@pytest.fixture
def client(daemon: FakeDaemon) -> TestClient:
    return TestClient(create_app(daemon))


def put_prefix(daemon: FakeDaemon, tokens: list[int], n_chunks: int) -> list[bytes]:
    refs = chunk_hashes(ACME, tokens, include_partial=False)[:n_chunks]
    for ref in refs:
        daemon.store.put(ACME, ref.key, np.zeros(CHUNK, np.uint8), parent=ref.parent)
    return [r.key for r in refs]


def scrape(
    client: TestClient, headers: dict[str, str] = ADMIN
) -> dict[tuple[str, frozenset], float]:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


# ---------------------------------------------------------------------- probes


def test_healthz_answers_without_a_token(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["node_id"] == "node-a"
    assert 0 <= body["uptime_s"] < 60


def test_readyz_follows_the_daemon(client: TestClient, daemon: FakeDaemon) -> None:
    assert client.get("/readyz").status_code == 200
    daemon.ready = False  # starting or draining
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "not_ready", "node_id": "node-a"}
    assert client.get("/healthz").status_code == 200  # alive, just not ready


# ---------------------------------------------------------------------- lookup


def test_lookup_by_token_ids_matches_full_chunks_only(
    client: TestClient, daemon: FakeDaemon
) -> None:
    tokens = prompt(3 * CT + 5)
    put_prefix(daemon, tokens, 2)
    response = client.post(
        "/v1/lookup", json={"namespace": ns_body(), "token_ids": tokens}, headers=TENANT
    )
    assert response.status_code == 200
    assert response.json() == {
        "matched_tokens": 2 * CT,
        "matched_chunks": 2,
        "requested_chunks": 3,
        "requested_tokens": 3 * CT + 5,
        "chunk_tokens": CT,
        "tiers": {"dram": 2 * CT},
    }


def test_lookup_by_chunk_hashes(client: TestClient, daemon: FakeDaemon) -> None:
    tokens = prompt(3 * CT)
    put_prefix(daemon, tokens, 1)
    hashes = [key.hex() for key in chunk_keys(ACME, tokens)]
    hashes[0] = hashes[0].upper()  # hex is case-insensitive
    response = client.post(
        "/v1/lookup", json={"namespace": ns_body(), "chunk_hashes": hashes}, headers=TENANT
    )
    assert response.status_code == 200
    body = response.json()
    assert (body["matched_tokens"], body["matched_chunks"], body["requested_chunks"]) == (CT, 1, 3)
    assert body["requested_tokens"] is None and body["tiers"] == {"dram": CT}


def test_token_counters_move_by_the_right_amounts(client: TestClient, daemon: FakeDaemon) -> None:
    before = scrape(client)
    tokens = prompt(3 * CT)
    put_prefix(daemon, tokens, 2)
    response = client.post(
        "/v1/lookup", json={"namespace": ns_body(), "token_ids": tokens}, headers=TENANT
    )
    assert response.status_code == 200
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("kvfabric_hit_tokens_total", tier="dram", tenant="acme") == 2 * CT
    assert delta("kvfabric_miss_tokens_total", tenant="acme") == CT
    assert delta("kvfabric_lookup_tokens_total", tenant="acme") == 3 * CT
    assert delta("kvfabric_lookups_total", tenant="acme") == 1
    assert delta("kvfabric_store_operation_duration_seconds_count", op="lookup_tokens") == 1
    assert delta("kvfabric_store_operation_duration_seconds_count", op="put") == 2
    assert delta("kvfabric_request_duration_seconds_count", plane="http", op="lookup") == 1
    assert delta("kvfabric_tier_objects", tier="dram") == 2
    assert delta("kvfabric_tier_in_bytes_total", tier="dram") == 2 * CHUNK


# ---------------------------------------------------------------------- stats and admin


def test_stats_reports_tiers_totals_namespaces_and_node(
    client: TestClient, daemon: FakeDaemon
) -> None:
    daemon.session_count = 3
    tokens = prompt(3 * CT)
    put_prefix(daemon, tokens, 2)
    daemon.store.lookup_tokens(ACME, tokens)
    response = client.get("/v1/stats", headers=ADMIN)
    assert response.status_code == 200
    body = response.json()
    assert (body["node_id"], body["sessions"], body["ready"]) == ("node-a", 3, True)
    assert body["uptime_s"] >= 0
    (tier,) = body["tiers"]
    assert (tier["name"], tier["kind"], tier["objects"]) == ("dram", "dram", 2)
    assert tier["capacity_bytes"] == 16 * CHUNK and tier["used_bytes"] == 2 * CHUNK
    assert tier["utilisation"] == pytest.approx(2 / 16)
    assert (tier["hit_tokens"], tier["bytes_in"], tier["corrupt_records"]) == (2 * CT, 2 * CHUNK, 0)
    totals = body["totals"]
    assert (totals["objects"], totals["puts"], totals["lookups"]) == (2, 2, 1)
    assert (totals["hit_tokens"], totals["miss_tokens"]) == (2 * CT, CT)
    assert totals["hit_rate"] == pytest.approx(2 / 3)
    assert body["namespaces"] == [
        {
            "model": "tiny",
            "tenant": "acme",
            "lookups": 1,
            "lookup_tokens": 3 * CT,
            "hit_tokens": 2 * CT,
        }
    ]


def test_admin_evict_by_bytes_then_all(client: TestClient, daemon: FakeDaemon) -> None:
    keys = put_prefix(daemon, prompt(3 * CT), 3)
    response = client.post("/v1/admin/evict", json={"bytes": 1}, headers=ADMIN)
    assert response.status_code == 200 and response.json() == {"evicted": 1}
    assert not daemon.store.contains(ACME, keys[2])  # the chain's tail went first
    response = client.post("/v1/admin/evict", json={"tier": "dram", "bytes": None}, headers=ADMIN)
    assert response.json() == {"evicted": 2}
    assert daemon.store.stats().tier("dram").evictions == 3


def test_admin_evict_of_an_unknown_tier_is_404(client: TestClient) -> None:
    response = client.post("/v1/admin/evict", json={"tier": "tape"}, headers=ADMIN)
    assert response.status_code == 404
    assert response.json()["error"]["kind"] == "not_found"
    assert "tape" in response.json()["error"]["message"]


def test_admin_flush_waits_for_ssd_writes(tmp_path: Path) -> None:
    daemon = make_daemon(
        tmp_path,
        AUTH,
        TierConfig(TierKind.DRAM, CHUNK, page_size=4096),
        TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
    )
    client = TestClient(create_app(daemon))
    keys = put_prefix(daemon, prompt(3 * CT), 3)  # dram holds one: two go to SSD
    response = client.post("/v1/admin/flush", headers=ADMIN)
    assert response.status_code == 200 and response.json() == {"flushed": True}
    assert daemon.store.stats().tier("ssd").objects == 2
    assert [daemon.store.tier_of(ACME, k) for k in keys] == ["ssd", "ssd", "dram"]
    daemon.store.store.close()


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (SpecError("bad"), 400),
        (UnavailableError("draining"), 503),
        (DeadlineExceededError("SSD demotions did not complete"), 504),
        (KVFabricError("store is closed"), 500),
    ],
)
def test_kvfabric_errors_map_to_status_and_kind(
    client: TestClient,
    daemon: FakeDaemon,
    monkeypatch: pytest.MonkeyPatch,
    error: KVFabricError,
    status: int,
) -> None:
    def fail(*_: object) -> None:
        raise error

    monkeypatch.setattr(daemon.store, "flush", fail)
    response = client.post("/v1/admin/flush", headers=ADMIN)
    assert response.status_code == status
    assert response.json() == {"error": {"kind": error.kind, "message": str(error)}}
    samples = scrape(client)
    assert (
        sample(samples, "kvfabric_request_errors_total", plane="http", op="flush", kind=error.kind)
        == 1
    )


# ---------------------------------------------------------------------- auth

PROTECTED = [
    ("GET", "/metrics", None),
    ("GET", "/v1/stats", None),
    ("POST", "/v1/lookup", {"namespace": ns_body(), "token_ids": [1]}),
    ("POST", "/v1/admin/evict", {}),
    ("POST", "/v1/admin/flush", None),
]
ADMIN_ONLY = [p for p in PROTECTED if p[1] not in ("/metrics", "/v1/lookup")]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
@pytest.mark.parametrize(
    "headers",
    [{}, bearer("wrong"), {"Authorization": f"Basic {ADMIN_TOKEN}"}, bearer(ADMIN_TOKEN + "x")],
)
def test_missing_or_wrong_token_is_401(
    client: TestClient,
    daemon: FakeDaemon,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
) -> None:
    put_prefix(daemon, prompt(CT), 1)
    response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert response.json()["error"]["kind"] == "unauthorized"
    assert len(daemon.store.store) == 1  # nothing was evicted
    assert daemon.store.stats().lookups == 0


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ONLY)
def test_tenant_token_on_admin_endpoints_is_403(
    client: TestClient, daemon: FakeDaemon, method: str, path: str, body: Any
) -> None:
    put_prefix(daemon, prompt(CT), 1)
    response = client.request(method, path, json=body, headers=TENANT)
    assert response.status_code == 403
    assert response.json()["error"]["kind"] == "forbidden"
    assert len(daemon.store.store) == 1


def test_tenant_token_may_only_look_up_its_own_tenant(
    client: TestClient, daemon: FakeDaemon
) -> None:
    body = {"namespace": ns_body("globex"), "token_ids": prompt(CT)}
    response = client.post("/v1/lookup", json=body, headers=TENANT)
    assert response.status_code == 403
    assert response.json()["error"]["kind"] == "forbidden"
    assert daemon.store.stats().lookups == 0  # refused before touching the store
    assert client.post("/v1/lookup", json=body, headers=bearer("globex-secret")).status_code == 200
    assert client.post("/v1/lookup", json=body, headers=ADMIN).status_code == 200


def test_metrics_need_the_admin_token(client: TestClient) -> None:
    # tenant labels would tell one tenant the others' names and hit counts
    assert client.get("/metrics", headers=TENANT).status_code == 403
    assert ("kvfabric_sessions", frozenset()) in scrape(client, ADMIN)


def test_admin_token_from_a_file_is_reread(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    daemon = make_daemon(tmp_path / "store", AuthConfig(token_file=str(token_file)))
    client = TestClient(create_app(daemon))
    assert client.get("/v1/stats", headers=bearer("first")).status_code == 200
    token_file.write_text("second\n")  # rotated
    assert client.get("/v1/stats", headers=bearer("first")).status_code == 401
    assert client.get("/v1/stats", headers=bearer("second")).status_code == 200
    daemon.store.store.close()


def test_an_unreadable_token_file_fails_closed(tmp_path: Path) -> None:
    daemon = make_daemon(tmp_path, AuthConfig(token_file=str(tmp_path / "missing")))
    client = TestClient(create_app(daemon))
    for headers in ({}, bearer("anything")):
        response = client.get("/v1/stats", headers=headers)
        assert response.status_code == 500
        assert response.json()["error"]["kind"] == "bad_config"
    daemon.store.store.close()


def test_without_tokens_auth_is_off(tmp_path: Path) -> None:
    daemon = make_daemon(tmp_path, AuthConfig())
    client = TestClient(create_app(daemon))
    assert client.get("/v1/stats").status_code == 200
    assert client.post("/v1/admin/evict", json={}).json() == {"evicted": 0}
    daemon.store.store.close()


# ---------------------------------------------------------------------- bad bodies

NS = ns_body()
HEX = "ab" * 16
BAD_BODIES = {
    "both": ({"namespace": NS, "token_ids": [1], "chunk_hashes": [HEX]}, "exactly one"),
    "neither": ({"namespace": NS}, "exactly one"),
    "short hex": ({"namespace": NS, "chunk_hashes": ["ab" * 15]}, "chunk_hashes.0"),
    "not hex": ({"namespace": NS, "chunk_hashes": [HEX, "zz" * 16]}, "chunk_hashes.1"),
    "token not int32": ({"namespace": NS, "token_ids": [1 << 31]}, "token_ids.0"),
    "token as string": ({"namespace": NS, "token_ids": ["1"]}, "token_ids.0"),
    "token as bool": ({"namespace": NS, "token_ids": [True]}, "token_ids.0"),
    "mla with heads": ({"namespace": ns_body(kind="mla"), "token_ids": [1]}, "MLA"),
    "zero layers": ({"namespace": ns_body(num_layers=0), "token_ids": [1]}, "num_layers"),
    "unknown dtype": ({"namespace": ns_body(dtype="int3"), "token_ids": [1]}, "int3"),
    "unknown kind": ({"namespace": ns_body(kind="linear"), "token_ids": [1]}, "kind"),
    "extra spec field": ({"namespace": ns_body(rope=1), "token_ids": [1]}, "rope"),
    "no model": ({"namespace": {"spec": SPEC.to_dict()}, "token_ids": [1]}, "model"),
    "extra field": ({"namespace": NS, "token_ids": [1], "tokens": [1]}, "tokens"),
    "no namespace": ({"token_ids": [1]}, "namespace"),
    "many hashes": ({"namespace": NS, "chunk_hashes": [HEX] * (MAX_KEYS + 1)}, "at most"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_lookup_bodies_are_422_with_a_clear_message(
    client: TestClient, daemon: FakeDaemon, case: str
) -> None:
    body, needle = BAD_BODIES[case]
    response = client.post("/v1/lookup", json=body, headers=TENANT)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["kind"] == "bad_request"
    assert needle in error["message"]
    assert response.json()["detail"]
    assert daemon.store.stats().lookups == 0
    assert (
        sample(
            scrape(client),
            "kvfabric_request_errors_total",
            plane="http",
            op="lookup",
            kind="bad_request",
        )
        == 1
    )


def test_too_many_token_ids_are_refused_without_echoing_them(
    client: TestClient, daemon: FakeDaemon
) -> None:
    """Counted before any id is validated: 413 at limits.lookup_max_tokens (default 1 Mi)."""
    limit = daemon.config.limits.lookup_max_tokens
    assert limit < MAX_TOKENS
    body = {"namespace": NS, "token_ids": [7] * (limit + 1)}
    response = client.post("/v1/lookup", json=body, headers=TENANT)
    assert response.status_code == 413
    assert response.json()["error"]["kind"] == "too_large"
    assert f"at most {limit}" in response.json()["error"]["message"]
    assert len(response.content) < 2048  # the input is never echoed back
    assert (
        sample(
            scrape(client),
            "kvfabric_request_errors_total",
            plane="http",
            op="lookup",
            kind="too_large",
        )
        == 1
    )


def test_a_million_bad_token_ids_are_refused_fast_and_summarised(
    client: TestClient, daemon: FakeDaemon
) -> None:
    """Regression: on the old code pydantic built one error per bad id, on the event loop:
    13 s for a million (every other request on the daemon waited)."""
    body = json.dumps({"namespace": NS, "token_ids": [1 << 40] * 1_000_000})
    start = time.monotonic()
    response = client.post(
        "/v1/lookup", content=body, headers={**TENANT, "Content-Type": "application/json"}
    )
    assert time.monotonic() - start < 5.0
    assert response.status_code == 422
    error = response.json()["error"]
    assert "body.token_ids.0: must be an integer in int32" in error["message"]
    assert error["message"].endswith("and 999990 more")
    assert len(response.json()["detail"]) == 10 and len(response.content) < 4096
    assert daemon.store.stats().lookups == 0


def test_many_bad_items_are_summarised(client: TestClient) -> None:
    response = client.post(
        "/v1/lookup", json={"namespace": NS, "chunk_hashes": ["x"] * 50}, headers=TENANT
    )
    assert response.status_code == 422
    assert len(response.json()["detail"]) == 10
    assert response.json()["error"]["message"].endswith("and 40 more")


def test_malformed_json_is_422(client: TestClient) -> None:
    response = client.post(
        "/v1/lookup",
        content=b'{"namespace": ',
        headers={**TENANT, "Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert response.json()["error"]["kind"] == "bad_request"


@pytest.mark.parametrize("body", [{"bytes": 0}, {"bytes": "10"}, {"tier": 3}, {"all": True}])
def test_bad_evict_bodies_are_422(client: TestClient, daemon: FakeDaemon, body: Any) -> None:
    put_prefix(daemon, prompt(CT), 1)
    response = client.post("/v1/admin/evict", json=body, headers=ADMIN)
    assert response.status_code == 422
    assert len(daemon.store.store) == 1


def test_oversized_body_is_413_before_parsing(daemon: FakeDaemon) -> None:
    client = TestClient(create_app(daemon, max_body_bytes=4096))
    body = json.dumps({"namespace": NS, "token_ids": prompt(2000)})
    response = client.post(
        "/v1/lookup", content=body, headers={**TENANT, "Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert daemon.store.stats().lookups == 0


def test_a_streamed_body_is_cut_off_at_the_limit(daemon: FakeDaemon) -> None:
    client = TestClient(create_app(daemon, max_body_bytes=4096))

    def body():  # no Content-Length: the limit applies to the bytes as they arrive
        yield b'{"token_ids": ['
        for _ in range(100):
            yield b"1, " * 100

    response = client.post(
        "/v1/lookup", content=body(), headers={**TENANT, "Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert daemon.store.stats().lookups == 0


def test_nodes_without_a_global_index_is_this_node_alone_for_any_known_caller(
    client: TestClient,
) -> None:
    answer = client.get("/v1/nodes", headers=TENANT)
    assert answer.status_code == 200
    assert answer.json() == {
        "nodes": [{"node_id": "node-a", "hardware_class": "generic"}],
        "cluster": False,
    }
    assert client.get("/v1/nodes").status_code == 401


# ---------------------------------------------------------------------- schema and threads


def test_openapi_schema_documents_bodies_bounds_and_bearer_auth(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/lookup",
        "/v1/stats",
        "/v1/nodes",
        "/v1/admin/evict",
        "/v1/admin/flush",
    } <= set(schema["paths"])
    lookup = schema["components"]["schemas"]["LookupRequest"]["properties"]
    assert lookup["token_ids"]["anyOf"][0]["maxItems"] == MAX_TOKENS
    assert lookup["chunk_hashes"]["anyOf"][0]["maxItems"] == MAX_KEYS
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "LookupResponse" in schema["components"]["schemas"]


def test_a_blocked_store_call_does_not_block_the_event_loop(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    released_in_time: list[bool] = []

    def slow_lookup(ns: Namespace, tokens: Any) -> LookupResult:
        entered.set()
        released_in_time.append(release.wait(5))  # an async endpoint would block the loop here
        return LookupResult(1, 0, 0, {})

    monkeypatch.setattr(daemon.store, "lookup_tokens", slow_lookup)

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=create_app(daemon))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvfabric") as http:
            lookup = asyncio.create_task(
                http.post("/v1/lookup", json={"namespace": NS, "token_ids": [1]}, headers=TENANT)
            )
            assert await asyncio.to_thread(entered.wait, 5)
            health = await http.get("/healthz")  # served while the lookup is still blocked
            release.set()
            return health.status_code, (await lookup).status_code

    assert asyncio.run(scenario()) == (200, 200)
    assert released_in_time == [True]


def test_cluster_scope_without_a_global_index_is_unavailable(client: TestClient) -> None:
    body = {"namespace": ns_body("acme"), "token_ids": prompt(CT), "scope": "cluster"}
    response = client.post("/v1/lookup", json=body, headers=ADMIN)
    assert response.status_code == 503
    assert response.json()["error"]["kind"] == "unavailable"
