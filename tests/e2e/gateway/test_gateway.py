"""``kvfabric gateway`` in front of real vLLM engines: placement by what the fabric holds,
prefill/decode hand-offs, streaming, tenants' queues and an engine dying mid-request.

Why: the gateway is the only part that sees every request before an engine does. If its
lookup hashes prompts differently from the connectors it routes blind; if its P/D hand-off
loses the KV the decode engine recomputes (or answers differently); if its queue or its
failure handling is wrong, callers wait forever or get a truncated answer that looks whole.
Only real engines show these: the gateway's own process tests (tests/integration/gateway/)
run with no engine.

Real parts only: OpenAI servers of vLLM's CPU build on the tiny model (``a`` beside daemon
``node-a``, ``b`` beside ``node-b``, both with KVFabricConnector ``kv_both``; the daemons share
a Redis index), ``kvfabric gateway`` child processes, httpx over loopback. Prompts are token
ids unless the test is about text. The two engines start once for the module, in parallel;
gateways are cheap, so each test starts the ones whose configuration it is about (a fresh
gateway plans from its hardware class's priors, so routing does not depend on what earlier
tests measured). Every timeout derives from the measured engine start.

- Routing: a prefix written to one node's fabric (by a request sent to that node's engine
  directly) sends prompts extending it to that engine: ``/v1/plan`` shows the holdings on that
  node and the answer's ``x-kvfabric-prefill`` names it, and the engine loads the prefix
  (``vllm:prompt_tokens_cached``). Parametrized over the holder, each the other's control
  (same config, only the holdings differ). The link is configured slow, so moving the prefix
  never pays and the holdings decide by the prefill they save.
- P/D: a gateway with ``a`` prefill and ``b`` decode, in pull mode and with ``push: true``:
  greedy token ids equal a monolithic run on ``a`` (under another ``cache_salt``, so nothing
  is reused), the headers name the engines and the mode, and ``b`` loads the prompt's chunks
  from the fabric (its external prefix-cache hits), pulled by node-b or pushed by node-a as
  the mode says. Control: the same prompt under another salt sent to ``b`` directly loads
  nothing.
- Streaming through a single engine and through P/D: several SSE events carrying the same
  token ids as the whole answer.
- ``/v1/chat/completions`` and text prompts (tokenized by an engine's ``/tokenize``),
  ``/v1/models``, ``GET /v1/plan``.
- Metrics: one request moves ``decisions_total``, ``served_tokens_total{tenant}`` (prompt plus
  output, exactly: for a stream too, with or without its usage event), the queue-wait and
  TTFT histograms of its tenant and class only.
- Admission: behind ``max_running: 1`` and a ``max_queued_tokens`` with room for one request,
  a burst of 8 from one tenant while engine ``a`` is frozen (SIGSTOP: one request waits there,
  one in the queue) gets exactly 6 answers 429 ``queue_full`` with an integer ``Retry-After``
  >= 1, the other two 200 once ``a`` continues; another tenant is still admitted, and the
  gateway serves afterwards.
- Priority: behind one engine with ``max_running: 1`` (frozen while the queue forms), an
  interactive request sent after queued batch ones reaches the engine right after the running
  one (engine ``a``'s request log, ``--enable-log-requests``: the order is the engine's, not
  the test's clocks, which a decoding engine starves on two cores); the same request sent as
  batch goes last.
- Failure (last: it kills engine ``b``): a stream on ``b`` whose engine is killed ends with an
  SSE ``engine_failed`` error and ``[DONE]`` well before the gateway's deadline; the next
  request is served by ``a`` with the right tokens.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from child_process import free_port
from daemon_process import DaemonProcess
from gateway_process import GatewayProcess
from scrape import scrape
from sse_tokens import carried_token_ids
from vllm_served import ServedEngine

from kvfabric.planning.validate import validate

MODEL_NAME = "tiny"
CHUNK_TOKENS = 256  # the connector's default
ENGINE_START_LIMIT_S = 600.0  # a cold first vLLM import on a loaded 2-core machine
PREFIX_TOKENS = 3 * CHUNK_TOKENS
STREAM_TOKENS = 32  # enough decode steps that a loaded API server still sends several events
# Priors near what the tiny model does on this 2-core CPU (prefill ~7k tokens/s, one decode
# stream ~200 tokens/s): both engines are one class, so a fresh gateway ties them but for
# the fabric's holdings.
CPU_CLASS = "cpu"
CLASSES = {CPU_CLASS: {"prefill_tps": 6000, "decode_tps": 200, "cost_per_hour": 1.0}}
# 1 MB/s: moving a token's KV (2 KiB) takes 2 ms, computing it 0.17 ms: a plan never pulls
# a prefix to another node, it goes where the prefix is.
SLOW_LINK = {"bytes_per_s": 1.0e6, "overlap": 0.95, "handoff_fixed_s": 0.005}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


def daemon_settings(redis_url: str, name: str) -> list[str]:
    return [
        "store.tiers.dram.capacity=256MiB",
        "store.tiers.ssd.capacity=1GiB",
        f"node_id={name}",
        "cluster.index=redis",
        f"cluster.redis_url={redis_url}",
        "cluster.heartbeat_s=0.2",
        "tcp.port=0",
        "cluster.transport=socket",
    ]


def connector(socket: str) -> dict:
    return {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": "kvfabric_connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_path": socket},
    }


def fabric_spec(model: Path) -> dict[str, Any]:
    """The KV spec the connector derives for the tiny model (engines run ``--dtype
    bfloat16``; ``chunk_tokens`` is the connector's default)."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {
        "num_layers": config["num_hidden_layers"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "dtype": "bfloat16",
        "chunk_tokens": CHUNK_TOKENS,
        "kind": "mha",
    }


def daemon_total(daemon: DaemonProcess, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample_name, sample_labels), value in scrape(daemon.http_url).items()
        if sample_name == name and labels.items() <= dict(sample_labels).items()
    )


def wait_until(what: str, check: Callable[[], bool], deadline_s: float) -> None:
    limit = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < limit, f"{what}: not within {deadline_s:.0f}s"
        time.sleep(0.1)


# -- requests ------------------------------------------------------------------------------


def body_for(tokens: list[int] | str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def headers_for(tenant: str | None = None, priority: str | None = None) -> dict[str, str]:
    headers = {}
    if tenant is not None:
        headers["X-KVFabric-Tenant"] = tenant
    if priority is not None:
        headers["X-KVFabric-Priority"] = priority
    return headers


def post(
    url: str,
    path: str,
    body: dict[str, Any],
    *,
    timeout: float,
    tenant: str | None = None,
    priority: str | None = None,
) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers_for(tenant, priority), timeout=timeout)


def complete(url: str, body: dict[str, Any], *, timeout: float, **who: str) -> httpx.Response:
    """A completion that must succeed (the status and the body quoted otherwise)."""
    response = post(url, "/v1/completions", body, timeout=timeout, **who)
    assert response.status_code == 200, (response.status_code, response.text[:2000])
    return response


def token_ids(response: httpx.Response) -> list[int]:
    return response.json()["choices"][0]["token_ids"]


def routed(response: httpx.Response) -> tuple[str | None, str | None, str | None]:
    h = response.headers
    return h.get("x-kvfabric-prefill"), h.get("x-kvfabric-decode"), h.get("x-kvfabric-mode")


@dataclass
class Streamed:
    status: int
    headers: httpx.Headers
    token_ids: list[int] = field(default_factory=list)
    events: int = 0  # SSE data events but [DONE]
    token_events: int = 0  # those that carry tokens
    errors: list[dict] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    usage: dict = field(default_factory=dict)
    ended_at: float = 0.0  # monotonic, when the stream closed


def stream(
    url: str,
    body: dict[str, Any],
    *,
    timeout: float,
    on_event: Callable[[Streamed], None] | None = None,
    **who: str,
) -> Streamed:
    """A streamed completion read to its end; ``on_event`` runs after each data event."""
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={**body, "stream": True},
        headers=headers_for(**who),
        timeout=timeout,
    ) as response:
        out = Streamed(response.status_code, response.headers)
        if response.status_code != 200:
            response.read()
            out.errors.append({"status": response.status_code, "body": response.text})
            out.ended_at = time.monotonic()
            return out
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                continue
            event = json.loads(line[len("data: ") :])
            out.events += 1
            if "error" in event:
                out.errors.append(event["error"])
            carried = carried_token_ids(event)
            out.token_ids.extend(carried)
            out.token_events += bool(carried)
            out.usage = event.get("usage") or out.usage
            if on_event is not None:
                on_event(out)
    out.ended_at = time.monotonic()
    return out


# -- the module's engines and gateways -----------------------------------------------------


@dataclass
class Cluster:
    node_a: DaemonProcess
    node_b: DaemonProcess
    a: ServedEngine
    b: ServedEngine
    spec: dict[str, Any]
    timeout: float  # a request never takes longer than a whole engine start
    work: Path
    gateways: dict[str, GatewayProcess] = field(default_factory=dict)

    def engine(self, engine_id: str) -> ServedEngine:
        return {"a": self.a, "b": self.b}[engine_id]

    def entry(self, engine_id: str, role: str = "both", **extra: Any) -> dict[str, Any]:
        return {
            "id": engine_id,
            "url": self.engine(engine_id).url,
            "role": role,
            "node_id": f"node-{engine_id}",
            "hardware_class": CPU_CLASS,
            **extra,
        }

    def gateway(self, name: str, engines: list[dict[str, Any]], **sections: Any) -> GatewayProcess:
        """The gateway ``name`` (started on first use, with every listed engine healthy)."""
        if name in self.gateways:
            return self.gateways[name]
        config = {
            "model": MODEL_NAME,
            "fabric": {"url": self.node_a.http_url, "token": None, **self.spec},
            "classes": CLASSES,
            "engines": engines,
            "link": SLOW_LINK,
            "tenants": {"max_queued_tokens": 65536},
            # far past any request here, so a test that sees an answer sooner than this knows
            # the gateway did not just wait for its deadline
            "deadlines": {"request_s": 3 * self.timeout, "connect_s": 5, "health_interval_s": 0.5},
            **sections,
        }
        gw = GatewayProcess(name, self.work, config)
        self.gateways[name] = gw
        gw.start().wait_ready(self.timeout)
        for e in engines:
            wait_until(
                f"gateway {name} sees engine {e['id']} healthy",
                lambda e=e: gw.metric("kvfabric_gateway_engine_healthy", engine=e["id"]) == 1,
                self.timeout,
            )
        return gw

    def both(self, name: str) -> GatewayProcess:
        """A gateway over ``a`` and ``b``, both prefilling and decoding."""
        return self.gateway(name, [self.entry("a"), self.entry("b")])

    def pd(self, push: bool) -> GatewayProcess:
        """A gateway with ``a`` prefilling and ``b`` decoding (``push``: ``a`` pushes)."""
        prefill = self.entry("a", "prefill", push=True) if push else self.entry("a", "prefill")
        return self.gateway(
            f"pd-{'push' if push else 'pull'}", [prefill, self.entry("b", "decode")]
        )

    def reference(self, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
        """Engine ``a``'s own answer, under a salt of its own: nothing cached is reused."""
        salted = {**body, "cache_salt": f"reference-{uuid.uuid4().hex}"}
        response = post(self.a.url, path, salted, timeout=self.timeout)
        assert response.status_code == 200, response.text[:2000]
        return response.json()

    def plan(self, gw: GatewayProcess, body: dict[str, Any], **who: str) -> dict[str, Any]:
        response = post(gw.url, "/v1/plan", body, timeout=self.timeout, **who)
        assert response.status_code == 200, response.text[:2000]
        return response.json()


@pytest.fixture(scope="module")
def cluster(
    tiny_model: Path, shared_redis, start_module_daemon, tmp_path_factory
) -> Iterator[Cluster]:
    node_a = start_module_daemon("node-a", *daemon_settings(shared_redis.url, "node-a"))
    node_b = start_module_daemon("node-b", *daemon_settings(shared_redis.url, "node-b"))
    work = tmp_path_factory.mktemp("gateway-e2e")
    template = work / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)  # the tiny model's tokenizer has no chat template
    a = ServedEngine("a", work, free_port())
    b = ServedEngine("b", work, free_port())
    made = None
    try:
        for core, (engine, node) in enumerate(((a, node_a), (b, node_b))):
            engine.start(
                tiny_model,
                MODEL_NAME,
                connector(node.socket),
                "--enable-prompt-tokens-details",
                "--chat-template",
                str(template),
                "--enable-log-requests",  # the order an engine received requests in
                # a core each where there are two (vLLM binds every engine to the same one)
                env_extra={"VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))},
            )
        started = max(e.wait_ready(ENGINE_START_LIMIT_S) for e in (a, b))
        print(f"engines healthy after {started:.1f}s")
        timeout = math.ceil(max(30.0, started))
        made = Cluster(node_a, node_b, a, b, fabric_spec(tiny_model), timeout, work)
        yield made
    finally:
        for gw in made.gateways.values() if made else ():
            gw.kill()
        for engine in (a, b):
            engine.kill()


# -- tests ---------------------------------------------------------------------------------


def test_the_gateway_lists_the_model_and_is_ready(cluster: Cluster) -> None:
    gw = cluster.both("main")
    assert httpx.get(gw.url + "/healthz", timeout=10).status_code == 200
    assert httpx.get(gw.url + "/readyz", timeout=10).status_code == 200
    models = httpx.get(gw.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    # control: a gateway whose only engine nobody serves is alive but not ready
    ghost = {"id": "ghost", "url": f"http://127.0.0.1:{free_port()}", "hardware_class": CPU_CLASS}
    lonely = GatewayProcess(
        "no-engine", cluster.work, {"model": MODEL_NAME, "classes": CLASSES, "engines": [ghost]}
    )
    cluster.gateways["no-engine"] = lonely
    lonely.start().wait_ready(cluster.timeout, path="/healthz")
    time.sleep(1.5)  # past its first health checks
    assert httpx.get(lonely.url + "/readyz", timeout=10).status_code == 503
    lonely.kill()


@pytest.mark.parametrize("holder", ["a", "b"])
def test_a_prompt_goes_to_the_engine_whose_node_holds_its_prefix(
    cluster: Cluster, holder: str
) -> None:
    other = "b" if holder == "a" else "a"
    gw = cluster.both(f"route-{holder}")  # fresh: both engines at their class's priors
    seed = 100 if holder == "a" else 200
    prefix = prompt(seed, PREFIX_TOKENS)
    full = prefix + prompt(seed + 1, 40)
    body = body_for(full, 4)
    before = cluster.plan(gw, body)
    assert before["prompt_tokens"] == len(full)
    assert before["holdings"].get(f"node-{holder}", 0) == 0, before  # nothing there yet

    # the prefix goes into the holder's fabric through its engine, not the gateway
    complete(cluster.engine(holder).url, body_for(prefix, 1), timeout=cluster.timeout)
    found: dict[str, Any] = {}

    def held() -> bool:
        found.update(cluster.plan(gw, body))
        return found["holdings"].get(f"node-{holder}", 0) >= PREFIX_TOKENS

    wait_until(f"node-{holder}'s holdings in the plan", held, cluster.timeout)
    assert found["holdings"].get(f"node-{holder}") == PREFIX_TOKENS, found
    assert found["holdings"].get(f"node-{other}", 0) == 0, found
    plan = found["plan"]
    assert (plan["prefill_engine"], plan["decode_engine"], plan["mode"]) == (
        holder,
        holder,
        "single",
    ), found
    assert plan["reused_tokens"] == PREFIX_TOKENS, found
    assert plan["pulled_tokens"] == 0, found
    # control: under a cache_salt (another tenant's namespace) the same tokens are not held
    salted = cluster.plan(gw, {**body, "cache_salt": f"other-{uuid.uuid4().hex}"})
    assert not any(salted["holdings"].values()), salted

    engine = cluster.engine(holder)
    cached = engine.metric("vllm:prompt_tokens_cached_total")
    answer = complete(gw.url, body, timeout=cluster.timeout)
    assert routed(answer) == (holder, holder, "single"), answer.headers
    assert float(answer.headers["x-kvfabric-queue-ms"]) >= 0.0
    assert len(token_ids(answer)) == 4
    assert engine.metric("vllm:prompt_tokens_cached_total") - cached >= PREFIX_TOKENS


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_prefill_on_a_decode_on_b_equals_a_monolithic_run(cluster: Cluster, push: bool) -> None:
    gw = cluster.pd(push)
    tokens = prompt(300 + push, 1100)
    full_chunks = len(tokens) // CHUNK_TOKENS
    body = body_for(tokens, 16)
    expected = cluster.reference(body)["choices"][0]["token_ids"]
    b, node_a, node_b = cluster.b, cluster.node_a, cluster.node_b
    external = "vllm:external_prefix_cache_hits_total"

    # control: b given the prompt directly, under a salt of its own, loads nothing
    hits = b.metric(external)
    control = body_for(tokens, 1, cache_salt=f"control-{uuid.uuid4().hex}")
    complete(b.url, control, timeout=cluster.timeout)
    assert b.metric(external) == hits

    cached = b.metric("vllm:prompt_tokens_cached_total")
    pulled = daemon_total(node_b, "kvfabric_pull_chunks_total", outcome="pulled")
    pushed = daemon_total(node_a, "kvfabric_push_chunks_total", outcome="pushed")
    answer = complete(gw.url, body, timeout=cluster.timeout)
    assert token_ids(answer) == expected
    assert routed(answer) == ("a", "b", "push" if push else "pull"), answer.headers
    # b computed (almost) nothing of the prompt: it loaded every full chunk from the fabric
    assert b.metric("vllm:prompt_tokens_cached_total") - cached >= full_chunks * CHUNK_TOKENS
    assert b.metric(external) - hits >= full_chunks * CHUNK_TOKENS
    if push:
        wait_until(
            "node-a's pushes",
            lambda: (
                daemon_total(node_a, "kvfabric_push_chunks_total", outcome="pushed") - pushed
                >= full_chunks
            ),
            cluster.timeout,
        )
    else:
        assert (
            daemon_total(node_b, "kvfabric_pull_chunks_total", outcome="pulled") - pulled
            >= full_chunks
        )
        assert daemon_total(node_a, "kvfabric_push_chunks_total", outcome="pushed") == pushed


@pytest.mark.parametrize("route", ["single", "pd"])
def test_a_stream_carries_the_same_tokens_as_the_whole_answer(cluster: Cluster, route: str) -> None:
    gw = cluster.both("main") if route == "single" else cluster.pd(push=False)
    tokens = prompt(400 + len(route), 600)
    body = body_for(tokens, STREAM_TOKENS)
    expected = cluster.reference(body)["choices"][0]["token_ids"]
    whole = complete(gw.url, body, timeout=cluster.timeout)
    assert token_ids(whole) == expected
    streamed = stream(
        gw.url, {**body, "stream_options": {"include_usage": True}}, timeout=cluster.timeout
    )
    assert streamed.status == 200
    assert streamed.errors == []
    assert streamed.done
    assert streamed.token_ids == expected
    # streamed, not one buffered answer. Not more: vLLM merges the outputs its API server
    # has not sent yet, so a loaded host sends 32 tokens in a few events (16 came in 2 once)
    assert streamed.token_events >= 2
    assert streamed.usage["completion_tokens"] == STREAM_TOKENS
    assert streamed.headers["content-type"].startswith("text/event-stream")
    prefill, decode, mode = routed(whole)
    assert (streamed.headers["x-kvfabric-prefill"], streamed.headers["x-kvfabric-decode"]) == (
        prefill,
        decode,
    )
    if route == "pd":
        assert (prefill, decode, mode) == ("a", "b", "pull")
    else:
        assert mode == "single" and prefill == decode


def test_chat_and_text_prompts_are_tokenized_by_an_engine(cluster: Cluster) -> None:
    gw = cluster.both("main")
    text = " ".join(f"w{n}" for n in prompt(500, 300))  # words of the tiny tokenizer
    tokenized = httpx.post(
        cluster.a.url + "/tokenize", json={"model": MODEL_NAME, "prompt": text}, timeout=30
    ).json()["tokens"]
    by_text = complete(gw.url, body_for(text, 8), timeout=cluster.timeout)
    by_ids = complete(gw.url, body_for(tokenized, 8), timeout=cluster.timeout)
    assert by_text.json()["usage"]["prompt_tokens"] == len(tokenized)
    assert token_ids(by_text) == token_ids(by_ids)
    assert routed(by_text)[0] in ("a", "b")
    # the plan counts the text as the engine does, by POST and by GET
    assert cluster.plan(gw, body_for(text, 8))["prompt_tokens"] == len(tokenized)
    got = httpx.get(
        gw.url + "/v1/plan", params={"prompt": text, "max_tokens": 8}, timeout=cluster.timeout
    )
    assert got.status_code == 200, got.text
    assert got.json()["prompt_tokens"] == len(tokenized)
    # control: one word more is one token more
    assert cluster.plan(gw, body_for(text + " w7", 8))["prompt_tokens"] == len(tokenized) + 1

    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": " ".join(f"w{n}" for n in prompt(501, 50))}],
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    through = post(gw.url, "/v1/chat/completions", chat, timeout=cluster.timeout)
    assert through.status_code == 200, through.text[:2000]
    assert routed(through)[0] in ("a", "b")
    answer = through.json()
    expected = cluster.reference(chat, "/v1/chat/completions")
    assert (
        answer["choices"][0]["message"]["content"] == (expected["choices"][0]["message"]["content"])
    )
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    planned = cluster.plan(gw, chat)
    assert planned["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    # a chat split between a prefill and a decode engine answers the same
    split = post(cluster.pd(push=False).url, "/v1/chat/completions", chat, timeout=cluster.timeout)
    assert split.status_code == 200, split.text[:2000]
    assert routed(split) == ("a", "b", "pull"), split.headers
    assert (
        split.json()["choices"][0]["message"]["content"]
        == (expected["choices"][0]["message"]["content"])
    )


def test_metrics_count_each_request_for_its_tenant_and_class(cluster: Cluster) -> None:
    gw = cluster.both("main")
    tenant = "metered"

    def snapshot() -> dict[str, float]:
        samples = gw.samples()

        def total(name: str, **labels: str) -> float:
            return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())

        return {
            "decisions": total("kvfabric_gateway_decisions_total"),
            "served": total("kvfabric_gateway_served_tokens_total", tenant=tenant),
            "served_other": total("kvfabric_gateway_served_tokens_total", tenant="default"),
            "wait_interactive": total(
                "kvfabric_gateway_queue_wait_seconds_count", tenant=tenant, priority="interactive"
            ),
            "wait_batch": total(
                "kvfabric_gateway_queue_wait_seconds_count", tenant=tenant, priority="batch"
            ),
            "ttft_interactive": total(
                "kvfabric_gateway_ttft_seconds_count", tenant=tenant, priority="interactive"
            ),
            "ttft_batch": total(
                "kvfabric_gateway_ttft_seconds_count", tenant=tenant, priority="batch"
            ),
            "lookup": total("kvfabric_gateway_phase_seconds_count", phase="lookup"),
            "decode": total("kvfabric_gateway_phase_seconds_count", phase="decode"),
            "tokenize": total("kvfabric_gateway_phase_seconds_count", phase="tokenize"),
            "depth": total("kvfabric_gateway_queue_depth", tenant=tenant),
            "healthy_a": total("kvfabric_gateway_engine_healthy", engine="a"),
            "healthy_b": total("kvfabric_gateway_engine_healthy", engine="b"),
        }

    before = snapshot()
    answer = complete(
        gw.url, body_for(prompt(600, 300), 12), timeout=cluster.timeout, tenant=tenant
    )
    usage = answer.json()["usage"]
    after = snapshot()
    assert after["decisions"] - before["decisions"] == 1
    assert after["served"] - before["served"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert after["served_other"] == before["served_other"]  # another tenant's stays put
    assert after["wait_interactive"] - before["wait_interactive"] == 1
    assert after["ttft_interactive"] - before["ttft_interactive"] == 1
    assert (after["wait_batch"], after["ttft_batch"]) == (
        before["wait_batch"],
        before["ttft_batch"],
    )
    assert after["lookup"] - before["lookup"] == 1
    assert after["decode"] - before["decode"] == 1
    assert after["tokenize"] == before["tokenize"]  # token ids need no tokenizing
    assert after["depth"] == 0
    assert (after["healthy_a"], after["healthy_b"]) == (1, 1)

    # the same tenant as batch moves the batch series only
    before = snapshot()
    complete(
        gw.url,
        body_for(prompt(601, 100), 4),
        timeout=cluster.timeout,
        tenant=tenant,
        priority="batch",
    )
    after = snapshot()
    assert after["wait_batch"] - before["wait_batch"] == 1
    assert after["ttft_batch"] - before["ttft_batch"] == 1
    assert after["wait_interactive"] == before["wait_interactive"]
    assert after["served"] - before["served"] == 100 + 4


@pytest.mark.parametrize("usage_event", [False, True], ids=["plain", "include_usage"])
def test_a_streams_served_tokens_are_its_prompt_and_output(
    cluster: Cluster, usage_event: bool
) -> None:
    """Counted from the relayed events: with or without the usage event a client may ask
    for (``stream_options.include_usage``), which carries no token."""
    gw = cluster.both("main")
    tenant = f"streamer-{usage_event}"
    extra = {"stream_options": {"include_usage": True}} if usage_event else {}
    before = gw.metric("kvfabric_gateway_served_tokens_total", tenant=tenant)
    streamed = stream(
        gw.url, body_for(prompt(602, 200), 10, **extra), timeout=cluster.timeout, tenant=tenant
    )
    assert streamed.errors == [] and streamed.done and len(streamed.token_ids) == 10
    wait_until(  # counted as the stream ends, after the client read its last event
        "the stream's served tokens",
        lambda: gw.metric("kvfabric_gateway_served_tokens_total", tenant=tenant) > before,
        cluster.timeout,
    )
    served = gw.metric("kvfabric_gateway_served_tokens_total", tenant=tenant) - before
    assert served == 200 + 10, f"{served} served for 200 prompt + 10 output tokens"


@contextlib.contextmanager
def frozen(engine: ServedEngine) -> Iterator[None]:
    """``engine``'s process group stopped (SIGSTOP) for the block, then continued: the gateway
    sends it a request that waits in its socket, so a queue forms behind it on an idle host (a
    decoding engine starves every other process of this 2-core host, the test's too, for
    seconds). Kept short: the gateway marks an engine down after three slow health checks."""
    assert engine.child is not None
    engine.child.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        engine.child.signal(signal.SIGCONT)


# The simulator's error bound here: within 2x. On this 2-core host the engines share the cores
# with their frontends, the gateway, the daemons and the client, which a one-request-at-a-time
# calibration does not see: benchmarks/plan_bench.py measures 0.16-0.5 for the medians (its
# target is 0.25); a gross model error (a wrong unit, a phase left out) is far past 1.
SIM_ERROR_BOUND = 1.0


@pytest.mark.slow
def test_the_simulator_predicts_this_clusters_ttft_and_tpot(cluster: Cluster) -> None:
    """Calibrate engine a, send a Poisson mix through a gateway over a and b, simulate the
    same requests on the calibrated model of the same cluster: the medians agree within the
    bound; a model of engines five times slower does not (the comparison can fail)."""
    # no node ids: every request on one engine, as validate() simulates it
    engines = [cluster.entry(e, max_running=4, node_id="") for e in ("a", "b")]
    gw = cluster.gateway("validation", engines)
    found = validate(
        [cluster.a.url, cluster.b.url],
        gw.url,
        MODEL_NAME,
        vocab=2000,
        max_running=4,
        host_cores=float(os.cpu_count() or 1),
        count=60,
        timeout_s=cluster.timeout,
        quick=True,
        process_groups=[cluster.a.pid, cluster.b.pid],
    )
    said = f"measured {found.measured}, simulated {found.simulated}, profile {found.profile}"
    assert found.error("ttft_p50_s") <= SIM_ERROR_BOUND, said
    assert found.error("tpot_p50_s") <= SIM_ERROR_BOUND, said
    # the control's model is five times off from what was measured, not from the calibration:
    # where the other worker's engines slowed this cluster by 3x, engines "5x slower" than
    # calibrated were only 1.4x off (seen: error 0.39)
    slowdown = max(
        1.0,
        found.measured.ttft_p50_s / found.simulated.ttft_p50_s,
        found.measured.tpot_p50_s / found.simulated.tpot_p50_s,
    )
    wrong = found.simulate(found.profile.scaled(5.0 * slowdown))
    assert found.error("ttft_p50_s", wrong) > SIM_ERROR_BOUND, (slowdown, wrong)
    assert found.error("tpot_p50_s", wrong) > SIM_ERROR_BOUND, (slowdown, wrong)


def test_the_gateway_advises_a_composition_for_what_it_served(cluster: Cluster) -> None:
    advisor = {"ttft_p99_s": 10.0, "tpot_p50_s": 1.0, "interval_s": 1, "min_requests": 6}
    gw = cluster.gateway("advised", [cluster.entry("a"), cluster.entry("b")], advisor=advisor)
    for seed in range(6):
        assert (
            complete(
                gw.url, body_for(prompt(900 + seed, 200), 8), timeout=cluster.timeout
            ).status_code
            == 200
        )

    def advised() -> bool:
        answer = httpx.get(f"{gw.url}/v1/advice", timeout=cluster.timeout).json()
        return answer["advice"] is not None

    wait_until("the gateway's advice", advised, cluster.timeout)
    answer = httpx.get(f"{gw.url}/v1/advice", timeout=cluster.timeout).json()
    assert answer["observed"]["requests"] == 6 and answer["observed"]["prompt_mean"] == 200
    advice = answer["advice"]
    assert advice["met"] and advice["prefill"]["hardware_class"] == CPU_CLASS
    engines = gw.metric("kvfabric_gateway_advised_engines", role="decode", hardware_class=CPU_CLASS)
    assert engines == advice["decode"]["engines"] >= 1
    unadvised = httpx.get(f"{cluster.both('main').url}/v1/advice", timeout=cluster.timeout)
    assert unadvised.status_code == 404 and unadvised.json()["error"]["kind"] == "no_advisor"


def test_a_flooding_tenant_gets_429_with_retry_after(cluster: Cluster) -> None:
    prompt_len, max_tokens = 64, 32
    budget = prompt_len + max_tokens
    gw = cluster.gateway(
        "flood",
        [cluster.entry("a", max_running=1)],
        # room for one queued request of a tenant, not two
        tenants={"max_queued_tokens": budget + budget // 2},
    )
    burst = 8
    answers: dict[str, httpx.Response | httpx.HTTPError] = {}
    gate = threading.Barrier(burst)

    def ask(name: str, tenant: str, seed: int) -> None:
        if tenant == "flood":
            gate.wait()
        try:
            answers[name] = post(
                gw.url,
                "/v1/completions",
                body_for(prompt(seed, prompt_len), max_tokens),
                timeout=3 * cluster.timeout,
                tenant=tenant,
            )
        except httpx.HTTPError as exc:  # reported below
            answers[name] = exc

    def depth(tenant: str) -> float:
        return gw.metric("kvfabric_gateway_queue_depth", tenant=tenant)

    def isolated(tenant: str) -> float:
        return gw.metric("kvfabric_gateway_isolated_total", tenant=tenant)

    threads = [
        threading.Thread(target=ask, args=(f"flood{i}", "flood", 700 + i)) for i in range(burst)
    ]
    calm = threading.Thread(target=ask, args=("calm", "calm", 799))
    with frozen(cluster.a):
        # one request waits at the frozen engine, one in the queue; the rest must be refused
        for t in threads:
            t.start()
        wait_until(
            "the flood answered or queued",
            lambda: len(answers) == burst - 2 and depth("flood") == 1,
            cluster.timeout,
        )
        calm.start()  # another tenant's queue is its own: it queues, or (isolation slots)
        # goes to the engine past the flood's queue
        wait_until(
            "calm queued or sent past the flood",
            lambda: depth("calm") == 1 or isolated("calm") == 1 or "calm" in answers,
            cluster.timeout,
        )
        refused_early = dict(answers)
    for t in [*threads, calm]:
        t.join(3 * cluster.timeout + 10)
    assert all(isinstance(r, httpx.Response) for r in answers.values()), answers
    responses = {name: r for name, r in answers.items() if isinstance(r, httpx.Response)}
    assert "calm" not in refused_early
    assert all(r.status_code == 429 for r in refused_early.values()), [
        (r.status_code, r.text[:300]) for r in responses.values()
    ]
    flood = [r for name, r in responses.items() if name != "calm"]
    assert sorted(r.status_code for r in flood) == [200, 200] + [429] * (burst - 2)
    for r in flood:
        if r.status_code == 429:
            retry = r.headers.get("Retry-After")
            assert retry is not None and retry.isdigit(), r.headers
            # at least a second; at most what the queue ahead (two requests) could ever need
            assert 1 <= int(retry) <= cluster.timeout, retry
            assert r.json()["error"]["kind"] == "queue_full", r.text
        else:
            assert len(token_ids(r)) == max_tokens
    assert responses["calm"].status_code == 200, responses["calm"].text
    assert gw.metric("kvfabric_gateway_rejected_total", tenant="flood") == burst - 2
    assert gw.metric("kvfabric_gateway_rejected_total", tenant="calm") == 0
    # and it keeps serving once the flood is over
    after = complete(gw.url, body_for(prompt(798, prompt_len), 4), timeout=cluster.timeout)
    assert len(token_ids(after)) == 4
    assert depth("flood") == 0


def _dispatch_order(
    cluster: Cluster, gw: GatewayProcess, last_priority: str
) -> tuple[list[str], dict[str, float]]:
    """Batch requests b1..b3 (b1 at engine a, b2 and b3 queued), then ``last``: the order
    engine a received them in (its request log: one at a time, ``max_running: 1``) and each
    one's queue wait as the gateway reported it (``x-kvfabric-queue-ms``)."""
    run = f"{last_priority}-{uuid.uuid4().hex[:8]}"
    tenant = f"serial-{last_priority}"
    answers: dict[str, httpx.Response] = {}
    failures: list[str] = []

    def send(name: str, priority: str, seed: int) -> None:
        body = body_for(prompt(seed, 32), 32, request_id=f"{run}-{name}")
        try:
            response = post(
                gw.url,
                "/v1/completions",
                body,
                timeout=3 * cluster.timeout,
                tenant=tenant,
                priority=priority,
            )
            answers[name] = response
            if response.status_code != 200:
                failures.append(f"{name}: {response.status_code} {response.text[:300]}")
        except httpx.HTTPError as exc:
            failures.append(f"{name}: {exc!r}")

    def depth() -> float:
        return gw.metric("kvfabric_gateway_queue_depth", tenant=tenant)

    seed = 800 if last_priority == "interactive" else 900
    threads = {
        name: threading.Thread(target=send, args=(name, priority, seed + i))
        for i, (name, priority) in enumerate(
            [("b1", "batch"), ("b2", "batch"), ("b3", "batch"), ("last", last_priority)]
        )
    }
    with frozen(cluster.a):
        threads["b1"].start()
        wait_until(
            "b1 dispatched",
            lambda: (
                gw.metric(
                    "kvfabric_gateway_queue_wait_seconds_count", tenant=tenant, priority="batch"
                )
                == 1
            ),
            cluster.timeout,
        )
        threads["b2"].start()
        wait_until("b2 queued", lambda: depth() == 1, cluster.timeout)
        threads["b3"].start()
        wait_until("b3 queued", lambda: depth() == 2, cluster.timeout)
        threads["last"].start()
        wait_until("last queued", lambda: depth() == 3, cluster.timeout)
        assert not answers, answers  # nothing came back from a frozen engine
    for t in threads.values():
        t.join(3 * cluster.timeout + 10)
    assert not failures, failures
    log = cluster.a.log_path.read_text(errors="replace")
    seen = {name: log.find(f"Received request cmpl-{run}-{name}") for name in threads}
    assert all(at >= 0 for at in seen.values()), (seen, cluster.a.log_tail())
    waits = {name: float(r.headers["x-kvfabric-queue-ms"]) for name, r in answers.items()}
    return sorted(seen, key=seen.__getitem__), waits


def test_an_interactive_request_overtakes_queued_batch_ones(cluster: Cluster) -> None:
    gw = cluster.gateway("serial", [cluster.entry("a", max_running=1)])
    order, waits = _dispatch_order(cluster, gw, "interactive")
    assert order == ["b1", "last", "b2", "b3"], (order, waits)
    # the gateway's own clock agrees: the last to arrive waited less than the batch ones
    assert waits["last"] < min(waits["b2"], waits["b3"]), waits
    # control: the same request sent as batch waits its turn
    order, waits = _dispatch_order(cluster, gw, "batch")
    assert order == ["b1", "b2", "b3", "last"], (order, waits)


def test_an_engine_killed_mid_stream_ends_the_stream_cleanly_and_the_next_request_moves(
    cluster: Cluster,
) -> None:
    """Runs last: it kills engine ``b`` (its whole process group)."""
    gw = cluster.both("failover")  # fresh: the holdings alone send the prefix to b
    prefix = prompt(1000, PREFIX_TOKENS)
    first = prefix + prompt(1001, 32)
    follow = prefix + prompt(1002, 32)
    follow_body = body_for(follow, 8)
    expected = cluster.reference(follow_body)["choices"][0]["token_ids"]
    complete(cluster.b.url, body_for(prefix, 1), timeout=cluster.timeout)
    wait_until(
        "node-b's holdings",
        lambda: cluster.plan(gw, body_for(first, 8))["holdings"].get("node-b", 0) >= PREFIX_TOKENS,
        cluster.timeout,
    )
    assert cluster.plan(gw, body_for(first, 8))["plan"]["prefill_engine"] == "b"

    max_tokens = 2000  # ~10 s of decoding here: the kill lands well inside it
    killed_at: list[float] = []

    def kill_b_early(out: Streamed) -> None:
        if not killed_at and len(out.token_ids) >= 3:
            killed_at.append(time.monotonic())
            cluster.b.kill()

    streamed = stream(
        gw.url, body_for(first, max_tokens), timeout=3 * cluster.timeout, on_event=kill_b_early
    )
    assert streamed.status == 200
    assert streamed.headers["x-kvfabric-prefill"] == "b", streamed.headers
    assert killed_at, "the stream ended before b was killed"
    assert not cluster.b.alive()
    assert len(streamed.token_ids) < max_tokens
    assert [e.get("kind") for e in streamed.errors] == ["engine_failed"], streamed.errors
    assert streamed.done  # data: [DONE] after the error: clients stop reading
    # well before the gateway's own deadline (3x this): it saw the engine go, it did not wait
    assert streamed.ended_at - killed_at[0] < cluster.timeout

    # the next request for the same prefix is served by a: retried there, or planned there
    answer = complete(gw.url, follow_body, timeout=cluster.timeout)
    assert routed(answer) == ("a", "a", "single"), answer.headers
    assert token_ids(answer) == expected
    wait_until(
        "b marked down",
        lambda: gw.metric("kvfabric_gateway_engine_healthy", engine="b") == 0,
        cluster.timeout,
    )
    assert gw.metric("kvfabric_gateway_engine_healthy", engine="a") == 1
    assert httpx.get(gw.url + "/readyz", timeout=10).status_code == 200
    assert gw.alive()
