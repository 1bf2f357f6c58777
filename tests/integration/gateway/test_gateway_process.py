"""The gateway as a process, before any engine answers, and its view of the fabric.

Real parts: ``kvfabric gateway`` child processes (engines declared on loopback ports nobody
listens on), kvfabric daemons with a Redis index. What a gateway owes its callers while no
engine can serve: ready says so (503), a completion fails at once with ``no_engine`` instead
of waiting for its deadline, bad requests are refused with the reason, keys are enforced,
oversized bodies never reach the parser. And the gateway's cluster lookup hashes prompts
into the very chunk keys a connector stores (a prefix put on one node shows on that node,
its extension on another is not credited past the shared prefix).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from child_process import free_port
from gateway_process import GatewayProcess

from kvfabric.client import Client
from kvfabric.gateway.holdings import FabricView
from kvfabric.gateway.upstream import Upstream
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "bfloat16", "chunk_tokens": 32}
START_LIMIT_S = 60.0


def gateway_config(**extra: object) -> dict:
    """Two engines on loopback ports nobody listens on, one class; ``extra`` replaces keys."""
    return {
        "model": "tiny",
        "engines": [
            {"id": "a", "url": f"http://127.0.0.1:{free_port()}", "hardware_class": "gpu"},
            {"id": "b", "url": f"http://127.0.0.1:{free_port()}", "hardware_class": "gpu"},
        ],
        "classes": {"gpu": {"prefill_tps": 1000, "decode_tps": 20}},
        "deadlines": {"request_s": 30, "connect_s": 1, "health_interval_s": 0.2},
        **extra,
    }


def start_gateway(work: Path, config: dict) -> GatewayProcess:
    gateway = GatewayProcess("gateway", work, config).start()
    gateway.wait_ready(START_LIMIT_S, path="/healthz")  # no engine: never /readyz
    return gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = {"api_keys": {"sk-a": {"tenant": "alice"}}}
    child = start_gateway(tmp_path_factory.mktemp("gateway"), gateway_config(tenants=keys))
    yield child.url
    child.kill()


AUTH = {"Authorization": "Bearer sk-a"}


def test_without_engines_it_is_alive_but_not_ready(gateway: str) -> None:
    assert httpx.get(gateway + "/healthz").status_code == 200
    ready = httpx.get(gateway + "/readyz")
    assert ready.status_code == 503
    assert ready.json()["engines"] == {
        "a": {"healthy": False, "hardware_class": "gpu"},
        "b": {"healthy": False, "hardware_class": "gpu"},
    }
    assert httpx.get(gateway + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_a_completion_no_engine_can_serve_fails_at_once(gateway: str) -> None:
    started = time.monotonic()
    answer = httpx.post(
        gateway + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, headers=AUTH
    )
    assert answer.status_code == 503 and answer.json()["error"]["kind"] == "no_engine"
    assert time.monotonic() - started < 5  # not the 30 s deadline


@pytest.mark.parametrize(
    ("body", "headers", "status", "kind"),
    [
        ({"prompt": [1]}, {}, 401, "unauthorized"),
        ({"prompt": [1]}, {"Authorization": "Bearer nope"}, 401, "unauthorized"),
        (b"{not json", AUTH, 400, "bad_request"),
        ({"prompt": [1], "model": "other"}, AUTH, 404, "model_not_found"),
        ({"prompt": [1, -1]}, AUTH, 400, "bad_request"),
        ({"prompt": [1]}, {**AUTH, "X-KVFabric-Priority": "asap"}, 400, "bad_request"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(
    gateway: str, body: object, headers: dict, status: int, kind: str
) -> None:
    if isinstance(body, bytes):
        answer = httpx.post(gateway + "/v1/completions", content=body, headers=headers)
    else:
        answer = httpx.post(gateway + "/v1/completions", json=body, headers=headers)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["kind"] == kind
    if status == 401:
        assert answer.headers["www-authenticate"] == "Bearer"


def test_an_oversized_body_is_refused_before_it_is_parsed(gateway: str) -> None:
    answer = httpx.post(gateway + "/v1/completions", content=b"[" * (17 << 20), headers=AUTH)
    assert answer.status_code == 413


def test_its_metrics_say_what_it_refused(gateway: str) -> None:
    text = httpx.get(gateway + "/metrics").text
    assert 'kvfabric_gateway_rejected_total{reason="no_engine",tenant="alice"}' in text
    assert 'kvfabric_gateway_engine_healthy{engine="a"} 0.0' in text


def test_a_wrong_config_file_stops_it_with_the_key_that_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(gateway_config(tenants={"weights": {"alice": 0}})))
    result = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "gateway", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "tenants.weights.alice: must be > 0" in result.stderr


def test_its_lookup_finds_each_node_s_prefix_by_the_connectors_keys(
    start_module_daemon, shared_redis
) -> None:
    def node(name: str):
        return start_module_daemon(
            name,
            f"node_id={name}",
            "cluster.index=redis",
            f"cluster.redis_url={shared_redis.url}",
            "cluster.heartbeat_s=0.2",
            "tcp.port=0",
            "cluster.transport=socket",
            f"cluster.hardware_class=class-{name}",
        )

    a, b = node("gw-a"), node("gw-b")
    nodes = httpx.get(b.http_url + "/v1/nodes").json()
    assert nodes["cluster"] and {n["node_id"] for n in nodes["nodes"]} >= {"gw-a", "gw-b"}
    spec = KVSpec(**SPEC)  # type: ignore[arg-type]
    ns = Namespace("tiny", spec, "salt-1")
    prompt = list(range(100, 100 + 4 * 32 + 5))  # four full chunks and a partial one
    chunk = np.zeros(spec.chunk_bytes, dtype=np.uint8)
    refs = chunk_hashes(ns, prompt)
    with Client(a.socket) as client:  # node a: the first three chunks
        for ref in refs[:3]:
            client.put(ns, ref.key, chunk, parent=ref.parent, num_tokens=ref.num_tokens)
    with Client(b.socket) as client:  # node b: the first one only
        client.put(ns, refs[0].key, chunk, parent=refs[0].parent, num_tokens=refs[0].num_tokens)

    async def look(salt: str) -> dict[str, int]:
        http = Upstream()
        await http.start()
        try:
            view = FabricView(http, b.http_url, "tiny", spec, None, 5.0)
            deadline = time.monotonic() + 10  # the index learns of puts asynchronously
            while True:
                found = await view.lookup(prompt, salt)
                held = dict(found.holdings.tokens_by_node)
                if held == {"gw-a": 96, "gw-b": 32} or time.monotonic() > deadline:
                    assert found.ok
                    return held
                await asyncio.sleep(0.1)
        finally:
            await http.close()

    assert asyncio.run(look("salt-1")) == {"gw-a": 96, "gw-b": 32}
    assert asyncio.run(look("")) == {}  # another cache_salt: another namespace, no hit


def test_an_engine_without_a_class_takes_its_node_s_from_the_registry(
    start_module_daemon, shared_redis, tmp_path: Path
) -> None:
    """Runs after the lookup test: nodes gw-a (class-gw-a) and gw-b are registered."""
    daemon = start_module_daemon(
        "gw-c",
        "node_id=gw-c",
        "cluster.index=redis",
        f"cluster.redis_url={shared_redis.url}",
        "cluster.heartbeat_s=0.2",
        "tcp.port=0",
        "cluster.transport=socket",
        "cluster.hardware_class=class-gw-c",
    )
    fabric = {"url": daemon.http_url, **SPEC}
    config = gateway_config(
        fabric=fabric,
        engines=[
            {"id": "on-a", "url": f"http://127.0.0.1:{free_port()}", "node_id": "gw-a"},
            {"id": "on-c", "url": f"http://127.0.0.1:{free_port()}", "node_id": "gw-c"},
            {"id": "nowhere", "url": f"http://127.0.0.1:{free_port()}", "node_id": "gw-z"},
        ],
        classes={
            "class-gw-a": {"prefill_tps": 1000, "decode_tps": 20},
            "gpu": {"prefill_tps": 1000, "decode_tps": 20},
        },
    )
    child = start_gateway(tmp_path, config)
    try:
        engines = httpx.get(child.url + "/readyz").json()["engines"]
    finally:
        child.kill()
    assert engines["on-a"]["hardware_class"] == "class-gw-a"  # registered, and profiled
    assert engines["on-c"]["hardware_class"] is None  # class-gw-c has no profile: left out
    assert engines["nowhere"]["hardware_class"] is None  # no such node
    assert "class-gw-c" in child.log_path.read_text()  # said why
