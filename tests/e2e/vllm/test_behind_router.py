"""kvfabric prefill and decode engines behind an unmodified vllm-router in its vLLM PD mode
(``--vllm-pd-disaggregation --prefill URL --decode URL``, ``--kv-connector nixl``, its default).

Real parts only: the vllm-router binary of its wheel, OpenAI servers of vLLM's CPU build on the
tiny model, two kvfabric daemons (prefill-a, decode-b) sharing a Redis index, httpx over HTTP.
The router sends the prefill engine ``max_tokens=1`` and its nixl template
(``do_remote_decode: true``), then the decode engine the original request plus the prefill
answer's ``kv_transfer_params`` verbatim; the connector answers in that dialect
(kvfabric_connectors/vllm/handoff.py). Greedy outputs must equal a monolithic engine's, with
only the last prompt token computed on the decode engine (its ``vllm:prompt_tokens_cached``;
the response's ``usage`` reports the prefill side's hits, vLLM's P/D accounting).

Engines (started once for the module, in parallel): ``mono`` (no connector: the reference
and the negative control's decode), ``prefill`` (pull), ``prefill_push`` (push to the decode
engine the router names in the request id, via ``push_targets``), ``decode``. The request
timeout given to the router derives from the measured engine start.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from redis_servers import free_port
from scrape import scrape
from sse_tokens import carried_token_ids
from vllm_served import ROUTER_BIN, Router, ServedEngine

MODEL_NAME = "tiny"
CHUNK_TOKENS = 256  # the connector's default
MAX_TOKENS = 8
ENGINE_START_LIMIT_S = 600.0  # a cold first vLLM import on a loaded 2-core machine


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


def connector(role: str, socket: str, **extra: object) -> dict:
    return {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": "kvfabric_connectors.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_path": socket, **extra},
    }


def daemon_total(daemon, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample_name, sample_labels), value in scrape(daemon.http_url).items()
        if sample_name == name and labels.items() <= dict(sample_labels).items()
    )


@dataclass
class Completion:
    token_ids: list[int]
    usage: dict
    events: int  # SSE data events that carry tokens (1 for a non-streaming answer)


def complete(url: str, tokens: list[int], *, stream: bool = False, timeout: float) -> Completion:
    body = {
        "model": MODEL_NAME,
        "prompt": tokens,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        response.raise_for_status()
        answer = response.json()
        return Completion(answer["choices"][0]["token_ids"], answer["usage"], 1)
    body["stream_options"] = {"include_usage": True}
    ids: list[int] = []
    usage: dict = {}
    events = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            carried = carried_token_ids(event)
            ids.extend(carried)
            events += bool(carried)
            usage = event.get("usage") or usage
    return Completion(ids, usage, events)


@dataclass
class Fabric:
    prefill_a: object
    decode_b: object
    mono: ServedEngine
    prefill: ServedEngine
    prefill_push: ServedEngine
    decode: ServedEngine
    pull: Router  # prefill -> decode
    push: Router  # prefill_push -> decode
    control: Router  # prefill -> mono (a decode engine without the connector)
    request_timeout_s: float

    def reference(self, tokens: list[int]) -> list[int]:
        return complete(self.mono.url, tokens, timeout=self.request_timeout_s).token_ids


@pytest.fixture(scope="module")
def fabric(tiny_model, shared_redis, start_module_daemon, tmp_path_factory) -> Iterator[Fabric]:
    assert ROUTER_BIN.exists(), "vllm-router is not installed: tests/install.sh installs it"
    prefill_a = start_module_daemon("prefill-a", *daemon_settings(shared_redis.url, "prefill-a"))
    decode_b = start_module_daemon("decode-b", *daemon_settings(shared_redis.url, "decode-b"))
    work = tmp_path_factory.mktemp("served")
    children: list = []

    def engine(name: str) -> ServedEngine:
        children.append(ServedEngine(name, work, free_port()))
        return children[-1]

    mono, prefill, prefill_push, decode = (
        engine(n) for n in ("mono", "prefill", "prefill_push", "decode")
    )
    details = "--enable-prompt-tokens-details"
    try:
        mono.start(tiny_model, MODEL_NAME, None, details)
        prefill.start(
            tiny_model,
            MODEL_NAME,
            connector("kv_producer", prefill_a.socket),
            details,  # the router copies the prefill's cached tokens into the answer
            "--enable-log-requests",  # "Received request": the kill test sees it arrive
        )
        prefill_push.start(
            tiny_model,
            MODEL_NAME,
            connector(
                "kv_producer",
                prefill_a.socket,
                push_targets={f"127.0.0.1:{decode.port}": "decode-b"},
            ),
            details,
        )
        decode.start(tiny_model, MODEL_NAME, connector("kv_consumer", decode_b.socket), details)
        started = max(
            e.wait_ready(ENGINE_START_LIMIT_S) for e in (mono, prefill, prefill_push, decode)
        )
        # a request never takes longer than a whole engine start on the same machine
        timeout = math.ceil(max(30.0, started))

        def router(name: str, p: ServedEngine, d: ServedEngine) -> Router:
            r = Router(name, work, free_port(), metrics_port=free_port())
            children.append(r)
            return r.start(
                "--vllm-pd-disaggregation",
                "--prefill",
                p.url,
                "--decode",
                d.url,
                "--policy",
                "round_robin",
                "--request-timeout-secs",
                str(timeout),
                "--worker-startup-timeout-secs",
                str(timeout),
            )

        routers = [router("pull", prefill, decode), router("push", prefill_push, decode)]
        routers.append(router("control", prefill, mono))
        for r in routers:
            r.wait_ready(timeout + 30)
        yield Fabric(prefill_a, decode_b, mono, prefill, prefill_push, decode, *routers, timeout)
    finally:
        for child in reversed(children):
            child.kill()


@pytest.mark.parametrize("length", [1024, 2000, 3000])
def test_pull_decode_equals_a_monolithic_run(fabric: Fabric, length: int) -> None:
    tokens = prompt(length, length)
    expected = fabric.reference(tokens)
    cached = fabric.decode.metric("vllm:prompt_tokens_cached_total")
    pulled = daemon_total(fabric.decode_b, "kvfabric_pull_chunks_total", outcome="pulled")
    routed = fabric.pull.metric("vllm_router_pd_decode_requests_total")
    out = complete(fabric.pull.url, tokens, timeout=fabric.request_timeout_s)
    assert out.token_ids == expected
    # only the last prompt token computed on the decode engine, all chunks pulled from node A
    assert fabric.decode.metric("vllm:prompt_tokens_cached_total") - cached == length - 1
    assert daemon_total(
        fabric.decode_b, "kvfabric_pull_chunks_total", outcome="pulled"
    ) - pulled == math.ceil(length / CHUNK_TOKENS)
    assert fabric.pull.metric("vllm_router_pd_decode_requests_total") - routed == 1
    # P/D accounting: the answer reports the prefill engine's own hits (none here), both in
    # vLLM (do_remote_prefill) and in the router, which copies them from the prefill's usage
    assert out.usage["prompt_tokens"] == length
    assert out.usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_streaming_responses_come_through_the_router(fabric: Fabric) -> None:
    tokens = prompt(7, 1536)
    expected = fabric.reference(tokens)
    cached = fabric.decode.metric("vllm:prompt_tokens_cached_total")
    out = complete(fabric.pull.url, tokens, stream=True, timeout=fabric.request_timeout_s)
    assert out.token_ids == expected
    # streamed, not one buffered answer. Not more: vLLM merges the outputs its API server
    # has not sent yet, so a loaded host sends the tokens in fewer events (8 came in 4 once)
    assert out.events >= 2
    assert out.usage["completion_tokens"] == MAX_TOKENS
    assert fabric.decode.metric("vllm:prompt_tokens_cached_total") - cached == len(tokens) - 1


def test_push_goes_to_the_decode_engine_the_router_names(fabric: Fabric) -> None:
    """The router overwrites client params, so the push target comes from the request id
    (``___decode_addr_<host:port>``) mapped by the prefill connector's ``push_targets``."""
    tokens = prompt(8, 2500)
    expected = fabric.reference(tokens)
    cached = fabric.decode.metric("vllm:prompt_tokens_cached_total")
    pushed = daemon_total(fabric.prefill_a, "kvfabric_push_chunks_total", outcome="pushed")
    out = complete(fabric.push.url, tokens, timeout=fabric.request_timeout_s)
    assert out.token_ids == expected
    assert fabric.decode.metric("vllm:prompt_tokens_cached_total") - cached == len(tokens) - 1
    chunks = math.ceil(len(tokens) / CHUNK_TOKENS)
    deadline = time.monotonic() + 10
    while (
        daemon_total(fabric.prefill_a, "kvfabric_push_chunks_total", outcome="pushed") - pushed
        < chunks
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert (
        daemon_total(fabric.prefill_a, "kvfabric_push_chunks_total", outcome="pushed") - pushed
        == chunks
    )
    # negative control: the pull-mode prefill engine (no push_targets) pushes nothing
    before = daemon_total(fabric.prefill_a, "kvfabric_push_chunks_total")
    complete(fabric.pull.url, prompt(9, 1024), timeout=fabric.request_timeout_s)
    assert daemon_total(fabric.prefill_a, "kvfabric_push_chunks_total") == before


def test_a_decode_engine_without_the_connector_computes_the_whole_prompt(
    fabric: Fabric,
) -> None:
    tokens = prompt(10, 1200)
    cached = fabric.mono.metric("vllm:prompt_tokens_cached_total")
    out = complete(fabric.control.url, tokens, timeout=fabric.request_timeout_s)
    assert fabric.mono.metric("vllm:prompt_tokens_cached_total") == cached  # nothing loaded
    assert out.usage["prompt_tokens_details"]["cached_tokens"] == 0  # the prefill's
    # the prefill did store the prompt: the same request behind the kvfabric decode loads it
    cached = fabric.decode.metric("vllm:prompt_tokens_cached_total")
    assert complete(fabric.pull.url, tokens, timeout=fabric.request_timeout_s).token_ids == (
        out.token_ids
    )
    assert fabric.decode.metric("vllm:prompt_tokens_cached_total") - cached == len(tokens) - 1


def test_a_prefill_engine_killed_mid_request_gives_an_error_or_a_recompute_in_time(
    fabric: Fabric,
) -> None:
    """Runs last: it kills the pull-mode prefill engine. Node A's daemon is stopped so the
    prefill's save holds the request inside the engine; the engine is killed while it is
    there. The router must answer within its request timeout: an HTTP error, or a correct
    output (recomputed by the decode engine)."""
    tokens = prompt(11, 3000)
    expected = fabric.reference(tokens)
    arrived = "Received request"
    seen = fabric.prefill.log_path.read_text(errors="replace").count(arrived)
    result: dict = {}

    def ask() -> None:
        started = time.monotonic()
        try:
            response = httpx.post(
                fabric.pull.url + "/v1/completions",
                json={
                    "model": MODEL_NAME,
                    "prompt": tokens,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
                timeout=fabric.request_timeout_s * 3,
            )
            result["status"], result["body"] = response.status_code, response.text
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)
        result["elapsed_s"] = time.monotonic() - started

    os.kill(fabric.prefill_a.proc.pid, signal.SIGSTOP)
    try:
        asking = threading.Thread(target=ask)
        asking.start()
        deadline = time.monotonic() + fabric.request_timeout_s
        while fabric.prefill.log_path.read_text(errors="replace").count(arrived) == seen:
            assert time.monotonic() < deadline and "elapsed_s" not in result, result
            time.sleep(0.1)
        time.sleep(1.0)  # inside the engine, its save waiting on the stopped daemon
        fabric.prefill.kill()
    finally:
        os.kill(fabric.prefill_a.proc.pid, signal.SIGCONT)
    asking.join(fabric.request_timeout_s * 3 + 10)
    assert not asking.is_alive(), "the router never answered"
    assert "error" not in result, result
    assert result["elapsed_s"] < fabric.request_timeout_s + 5, result
    if result["status"] == 200:
        assert json.loads(result["body"])["choices"][0]["token_ids"] == expected
    else:
        assert result["status"] >= 500, result
        assert result["body"].strip(), result  # a clear error, not an empty reply
