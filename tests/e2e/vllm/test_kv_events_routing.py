"""The fabric's blocks as vLLM KV events, end to end: in a served engine's own event stream,
and steering an unmodified vllm-router ``kv_aware`` to the engine whose node holds a prompt.

Why: a KV-aware router credits a worker only with blocks it hears about. kvfabric reports
them twice: the connector relays its namespaces' blocks into the engine's publisher
(``take_events``, kvfabric_connectors/vllm/events.py), and each daemon publishes its node's
inventory (``kv_events.endpoint``). If either is wrong the router misroutes, or never
notices an eviction and keeps sending a prompt where it is no longer held.

Real parts only: OpenAI servers of vLLM's CPU build on the tiny model, kvfabric daemons (one
per engine, no cluster index), the vllm-router binary of its wheel, ZMQ subscribers that
decode with vLLM's ``KVEventBatch`` and follow sequences as the router does
(tests/support/kv_event_stream.py). Prompts are token ids.

- ``relay`` (engine A): the connector (kv_both) and ``--kv-events-config`` (vLLM binds only
  ``tcp://*:PORT``), vLLM's prefix caching off, so every block on A's stream is the fabric's:
  ``BlockStored`` medium ``CPU`` with the prompt's token ids, in the engine's block size
  (128 here: the fabric's 256-token chunks are 2 blocks), chained; after an admin eviction
  on A's daemon, ``BlockRemoved``. vLLM publishes connector events only when its scheduler
  steps, so an idle engine holds them until its next request: the test asks a one-token
  request to make it step. Negative control: ``plain``, the same engine without the
  connector (prefix caching on), publishes its own ``GPU`` blocks and no ``CPU`` one.
- Routing: engines A and B, each with the connector on its own daemon, prefix caching off
  (the only cache credit is the fabric's); a ``kv_aware`` router fed by the two daemons'
  streams (``--kv-event-source URL=daemon endpoint``, with replay, block size 16). A prefix
  written only through B (warmed directly) sends prompts that start with it to B, credited
  at the CPU penalty (debug log ``KV prefix decision``), and B loads it from the fabric
  (``vllm:prompt_tokens_cached``); a prefix only on A goes to A (the control: a router
  ignoring events would break one tie or the other); after B's daemon evicts the prefix the
  router credits nothing (``credited_prefix_tokens=0``, lookup ``miss``).

Engines start once for the module, in parallel; timeouts derive from the measured start.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from child_process import free_port
from kv_event_stream import EventFollower
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm_served import ROUTER_BIN, Router, ServedEngine

MODEL_NAME = "tiny"
CHUNK_TOKENS = 256  # the connector's default
ENGINE_BLOCK = 128  # ServedEngine's --block-size
ROUTER_BLOCK = 16  # the daemons' kv_events.block_size and the router's
ENGINE_START_LIMIT_S = 600.0  # a cold first vLLM import on a loaded 2-core machine
HOST_CREDIT = 0.8  # vllm-router's --kv-penalty-host default: medium CPU
ANSI = re.compile(r"\x1b\[[0-9;]*m")
DECISION = re.compile(
    r'KV prefix decision outcome="(?P<outcome>[^"]+)" worker="(?P<worker>[^"]+)" '
    r"input_tokens=(?P<input>\d+) new_prefill_tokens=(?P<new>[\d.]+) "
    r"credited_prefix_tokens=(?P<credited>[\d.]+)"
)
ADVANCED = re.compile(r"kv_index (?:live|replay) sequence advanced source=(\S+) rank=0 seq=(\d+)")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


DAEMON_SETTINGS = [
    "store.tiers.dram.capacity=256MiB",
    "store.tiers.ssd.capacity=1GiB",
    "kv_events.endpoint=tcp://127.0.0.1:*",
    "kv_events.replay_endpoint=tcp://127.0.0.1:*",
    f"kv_events.block_size={ROUTER_BLOCK}",
]


def connector(socket: str) -> dict:
    return {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": "kvfabric_connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_path": socket},
    }


def events_config(port: int, replay_port: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",  # vLLM binds only with '*'
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )


def complete(url: str, tokens: list[int], timeout: float, max_tokens: int = 4) -> dict:
    response = httpx.post(
        url + "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        timeout=timeout,
    )
    response.raise_for_status()
    return response.json()


def admin_evict(daemon) -> int:
    response = httpx.post(f"{daemon.http_url}/v1/admin/evict", json={"tier": None}, timeout=30)
    response.raise_for_status()
    return int(response.json()["evicted"])


@dataclass
class Stack:
    daemon_a: object
    daemon_b: object
    a: ServedEngine  # connector + --kv-events-config (the relay)
    b: ServedEngine  # connector
    plain: ServedEngine  # --kv-events-config, no connector
    a_events: str  # tcp://127.0.0.1:port of A's engine publisher
    a_replay: str
    plain_events: str
    plain_replay: str
    router: Router  # kv_aware over A and B, fed by their daemons' streams
    timeout_s: float

    def router_log(self) -> str:
        return ANSI.sub("", self.router.log_path.read_text(errors="replace"))

    def decisions(self, since: int) -> list[re.Match[str]]:
        return list(DECISION.finditer(self.router_log()[since:]))

    def wait_router_applied(self, worker: str, seq: int) -> None:
        """Until the router's debug log says it applied ``worker``'s batch ``seq``."""
        deadline = time.monotonic() + 30
        while not any(
            source == worker and int(s) >= seq for source, s in ADVANCED.findall(self.router_log())
        ):
            assert time.monotonic() < deadline, f"router never applied {worker} seq {seq}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tiny_model, start_module_daemon, tmp_path_factory) -> Iterator[Stack]:
    assert ROUTER_BIN.exists(), "vllm-router is not installed: tests/install.sh installs it"
    daemon_a = start_module_daemon("events-a", *DAEMON_SETTINGS)
    daemon_b = start_module_daemon("events-b", *DAEMON_SETTINGS)
    work = tmp_path_factory.mktemp("served")
    children: list = []
    try:
        a, b, plain = (ServedEngine(n, work, free_port()) for n in ("a", "b", "plain"))
        children += [a, b, plain]
        ports = {name: (free_port(), free_port()) for name in ("a", "plain")}
        no_prefix_cache = "--no-enable-prefix-caching"
        a.start(
            tiny_model,
            MODEL_NAME,
            connector(daemon_a.socket),
            no_prefix_cache,
            "--kv-events-config",
            events_config(*ports["a"]),
        )
        b.start(tiny_model, MODEL_NAME, connector(daemon_b.socket), no_prefix_cache)
        plain.start(
            tiny_model, MODEL_NAME, None, "--kv-events-config", events_config(*ports["plain"])
        )
        started = max(e.wait_ready(ENGINE_START_LIMIT_S) for e in (a, b, plain))
        # a request never takes longer than a whole engine start on the same machine
        timeout = math.ceil(max(30.0, started))
        router = Router("router", work, free_port(), metrics_port=free_port())
        children.append(router)
        router.start(
            "--worker-urls",
            a.url,
            b.url,
            "--policy",
            "kv_aware",
            "--kv-event-model",
            MODEL_NAME,
            "--kv-event-block-size",
            str(ROUTER_BLOCK),
            "--kv-event-source",
            f"{a.url}={daemon_a.info['kv_events_endpoint']}",
            "--kv-event-source",
            f"{b.url}={daemon_b.info['kv_events_endpoint']}",
            "--kv-event-replay-source",
            f"{a.url}={daemon_a.info['kv_events_replay_endpoint']}",
            "--kv-event-replay-source",
            f"{b.url}={daemon_b.info['kv_events_replay_endpoint']}",
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "debug",
            "--request-timeout-secs",
            str(timeout),
            "--worker-startup-timeout-secs",
            str(timeout),
        )
        router.wait_ready(timeout + 30)
        local = "tcp://127.0.0.1:{}".format
        yield Stack(
            daemon_a,
            daemon_b,
            a,
            b,
            plain,
            local(ports["a"][0]),
            local(ports["a"][1]),
            local(ports["plain"][0]),
            local(ports["plain"][1]),
            router,
            timeout,
        )
    finally:
        for child in reversed(children):
            child.kill()


def served_until(stack: Stack, engine: ServedEngine, sub: EventFollower, done, what: str) -> None:
    """Pump ``sub`` until ``done(sub)``; vLLM publishes connector events when its scheduler
    steps, so an idle engine is asked one-token requests (a prompt too short to be a chunk:
    it adds nothing to the fabric) until they come."""
    deadline = time.monotonic() + stack.timeout_s
    while not done(sub):
        assert time.monotonic() < deadline, f"{what}: not seen; {sub.events[-10:]}"
        complete(engine.url, [11, 12, 13], stack.timeout_s, max_tokens=1)
        sub.pump(0.5)


# ---------------------------------------------------------------------- the relay


def test_the_engine_stream_carries_the_fabrics_blocks_and_their_eviction(stack: Stack) -> None:
    tokens = prompt(1, 2 * CHUNK_TOKENS + 8)  # two whole chunks and a few tokens
    saved = tokens[: 2 * CHUNK_TOKENS]
    chunks = [saved[:CHUNK_TOKENS], saved[CHUNK_TOKENS:]]
    with EventFollower(stack.a_events, stack.a_replay) as sub:
        complete(stack.a.url, tokens, stack.timeout_s)

        def stored(s: EventFollower) -> list[BlockStored]:
            return [e for e in s.events if isinstance(e, BlockStored) and e.token_ids in chunks]

        served_until(stack, stack.a, sub, lambda s: len(stored(s)) >= 2, "the prompt's chunks")
        first, second = stored(sub)[:2]
        assert [t for e in (first, second) for t in e.token_ids] == saved
        assert {first.medium, second.medium} == {"CPU"}  # the fabric's DRAM tier
        assert first.block_size == second.block_size == ENGINE_BLOCK
        assert len(first.block_hashes) == len(second.block_hashes) == CHUNK_TOKENS // ENGINE_BLOCK
        assert first.parent_block_hash is None
        assert second.parent_block_hash == first.block_hashes[-1]
        # no GPU blocks: vLLM's prefix caching is off, every block here is the fabric's
        assert not [e for e in sub.events if isinstance(e, BlockStored) and e.medium != "CPU"]

        assert admin_evict(stack.daemon_a) >= 2
        hashes = set(first.block_hashes + second.block_hashes)

        def removed(s: EventFollower) -> set:
            return {
                h
                for e in s.events
                if isinstance(e, BlockRemoved) and e.medium == "CPU"
                for h in e.block_hashes
            }

        served_until(stack, stack.a, sub, lambda s: hashes <= removed(s), "the eviction")
        assert not any((h, "CPU") in sub.state.held for h in hashes)


def test_an_engine_without_the_connector_publishes_no_fabric_blocks(stack: Stack) -> None:
    """The negative control: the same prompt on the same kind of engine, without the
    connector; its own prefix cache's blocks (GPU) come, no CPU block does."""
    tokens = prompt(1, 2 * CHUNK_TOKENS + 8)
    with EventFollower(stack.plain_events, stack.plain_replay) as sub:
        complete(stack.plain.url, tokens, stack.timeout_s)
        deadline = time.monotonic() + stack.timeout_s
        while not any(isinstance(e, BlockStored) for e in sub.events):
            assert time.monotonic() < deadline, "the engine published nothing"
            sub.pump(0.5)
        sub.pump(2.0)  # whatever else this request published
    stored = [e for e in sub.events if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"GPU"}
    assert [t for e in stored for t in e.token_ids][: 2 * CHUNK_TOKENS] == tokens[
        : 2 * CHUNK_TOKENS
    ]


# ---------------------------------------------------------------------- routing


def warm(stack: Stack, engine: ServedEngine, daemon, tokens: list[int]) -> None:
    """Serve ``tokens`` on ``engine`` directly (the router does not see it), then wait until
    its daemon announced every block and the router applied that batch."""
    blocks = {tuple(tokens[i : i + ROUTER_BLOCK]) for i in range(0, len(tokens), ROUTER_BLOCK)}
    with EventFollower(
        daemon.info["kv_events_endpoint"], daemon.info["kv_events_replay_endpoint"]
    ) as sub:
        complete(engine.url, tokens, stack.timeout_s)

        def announced(state) -> bool:
            held = {tuple(state.tokens[h]) for h, medium in state.held if medium == "CPU"}
            return blocks <= held

        sub.wait_until(announced, stack.timeout_s)
        stack.wait_router_applied(engine.url, sub.last_seq)


def route(stack: Stack, tokens: list[int]) -> re.Match[str]:
    """Send ``tokens`` through the router; its decision for this request."""
    mark = len(stack.router_log())
    complete(stack.router.url, tokens, stack.timeout_s)
    (decision,) = stack.decisions(mark)
    return decision


def test_the_router_sends_a_prefix_where_the_fabric_holds_it(stack: Stack) -> None:
    prefix_b = prompt(100, 4 * CHUNK_TOKENS)  # 1024 tokens, written only through B
    prefix_a = prompt(200, 4 * CHUNK_TOKENS)  # and another only through A
    warm(stack, stack.b, stack.daemon_b, prefix_b)
    warm(stack, stack.a, stack.daemon_a, prefix_a)
    least = math.floor(len(prefix_b) * HOST_CREDIT) - 1
    for i in range(3):  # distinct suffixes: not one lucky tie
        cached_a = stack.a.metric("vllm:prompt_tokens_cached_total")
        cached_b = stack.b.metric("vllm:prompt_tokens_cached_total")
        decision = route(stack, prefix_b + prompt(300 + i, 64))
        assert decision["worker"] == stack.b.url, decision.group(0)
        assert float(decision["credited"]) >= least, decision.group(0)
        assert int(decision["input"]) == len(prefix_b) + 64
        # B loaded the prefix from its node: the fabric's chunks, nothing from A
        assert stack.b.metric("vllm:prompt_tokens_cached_total") - cached_b == len(prefix_b)
        assert stack.a.metric("vllm:prompt_tokens_cached_total") == cached_a
    # the control: the prefix only A's node holds goes to A
    decision = route(stack, prefix_a + prompt(400, 64))
    assert decision["worker"] == stack.a.url, decision.group(0)
    assert float(decision["credited"]) >= least, decision.group(0)

    # B's node evicts it: the router hears of it and credits nothing any more
    with EventFollower(
        stack.daemon_b.info["kv_events_endpoint"], stack.daemon_b.info["kv_events_replay_endpoint"]
    ) as sub:
        sub.pump(0.5)
        assert admin_evict(stack.daemon_b) >= 4
        sub.wait_until(lambda s: sub.last_seq >= 0 and not any(m == "CPU" for _, m in s.held), 30)
        stack.wait_router_applied(stack.b.url, sub.last_seq)
    misses = stack.router.metric("vllm_router_kv_placement_lookups_total", result="miss")
    decision = route(stack, prefix_b + prompt(500, 64))
    assert float(decision["credited"]) == 0, decision.group(0)
    assert (
        stack.router.metric("vllm_router_kv_placement_lookups_total", result="miss") == misses + 1
    )
