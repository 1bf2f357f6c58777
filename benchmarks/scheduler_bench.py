"""Scheduler benchmark: kvfabric gateway vs vllm-router kv_aware, proxy overhead, tenants.

The gateway's TTFT against vllm-router's kv_aware on one cluster, its proxy overhead, and its
tenants' isolation, fair shares and priority classes.

Real parts only, router_bench's harness (imported from it, not copied): ``ENGINES`` vLLM CPU
OpenAI servers of the tests' random-weight tiny Llama, each with KVFabricConnector
(``kv_both``) on a node daemon of its own publishing its inventory as vLLM KV events, the
``vllm-router`` binary (``--policy kv_aware`` on those events) and ``kvfabric gateway``.

**The shared index.** Unlike router_bench's nodes, these daemons share a global index
(``cluster.index=redis`` on one redis-server the benchmark starts, socket peer transport): the
gateway's ``fabric.url`` (node 0's daemon) answers cluster lookups that see every node. With
it an engine's connector also finds a prefix another node holds and pulls it instead of
computing it, so where a request goes matters less than in router_bench (a miss costs a pull,
not a prefill). Both routers face this same setup: the nodes' KV event streams then also
announce the chunks other nodes hold (``kv_events.remote``, credited by vllm-router as
external).

**The gateway's priors** are measured here before the phases, as an operator would configure
them: the hardware class's prefill and decode tokens per second (engine 0; the gateway
refines them with what it observes) and the link: what an engine's pull of a prefix that
another node computed costs over finding it in its own cache (``prefix_pull_ms``: the
fastest of two pulls per peer, the first also connects), as bytes per second of that
prefix's KV (``link_bytes_per_s_prior``; ``overlap`` 0: no engine pushes, a P/D hand-off is
a pull after the prefill). The gateway does not measure links itself, and the interface's
example (1 GB/s, overlap 0.95) makes it pull and disaggregate where that costs far more here
than it assumes.

- ``ttft_p50_vs_vllm_router_kv_aware``: client TTFT p50 through the gateway over the same
  through vllm-router kv_aware, on router_bench's shared-prefix workload (its prefixes,
  suffixes, repeats, arrival order and ``CONCURRENCY`` streaming clients), run twice per
  router in the order vllm-router, gateway, gateway, vllm-router (a drift over the run
  cancels), each run on prefixes of its own drawn with a fixed seed so that none inherits
  another's caches; both routers stay up, one idle while the other is measured. The
  gateway's engines keep the default max_running: no request waits in it at this
  concurrency;
- ``proxy_overhead_ms_p50``: a small non-streamed request (``OVERHEAD_PROMPT_TOKENS`` random
  tokens, ``OUTPUT_TOKENS`` out) sent through a gateway over engine 0 alone and to engine 0
  directly, back to back (which goes first alternates), sequentially: the p50 of the
  per-pair differences, in ms.

Tenants, through a gateway over engine 0 alone with ``max_running`` = ``SCHED_MAX_RUNNING``
(so requests wait in the gateway, not in the engine), streamed requests of
``TENANT_PROMPT_TOKENS`` random tokens (less than one engine block: no request reuses
another's KV) and ``TENANT_OUTPUT_TOKENS`` out. The capacity (requests per second) is first
measured through that gateway with closed-loop clients; the rates derive from it:

- ``light_tenant_p99_ttft_flooded_vs_alone``: a light tenant's Poisson arrivals (rate
  ``HEAVY_LOAD`` x capacity / ``HEAVY_FACTOR``) alone, then with a heavy tenant's arrivals
  at ``HEAVY_FACTOR`` x its rate (over capacity: the heavy tenant's backlog grows in the
  gateway); the light tenant's client p99 TTFT flooded over alone (same arrival times and
  prompts). The gateway does not preempt: a light request still waits for a slot, i.e. the
  rest of a running heavy request; one sent while another light one still waits is queued
  level with the heavy tenant's head (equal weights) and waits for one more; and the flood
  loads the two shared cores too.
  ``..._fifo``: the same flood with both streams sent as one tenant (one tenant's queue is
  first come, first served): the light requests wait behind the heavy backlog;
- ``fair_share_error``: tenants of weights ``FAIR_WEIGHTS`` with closed-loop clients (more
  than the gateway runs) and requests of different sizes (``FAIR_SIZES``); over a window
  after a warm-up, the largest |served token share - weight share|, served tokens read from
  ``kvfabric_gateway_served_tokens_total{tenant}``. ``fair_backlogged_share``: the share of
  the window's dispatches at which every tenant had a request sent and not yet dispatched
  (the client's send time, plus the gateway's ``x-kvfabric-queue-ms``);
- ``interactive_p99_ttft_vs_batch``: one tenant with a batch backlog (closed-loop clients,
  ``X-KVFabric-Priority: batch``) and interactive Poisson arrivals at a quarter of the
  capacity: p99 TTFT of the interactive requests over that of the batch ones sent meanwhile.

Percentiles interpolate (``numpy.percentile``'s way): the p99 of the quick run's 60 light
requests lies between its two largest. Every request of the tenant experiments is written to
the work directory (``samples-*.json``: stream, send time, TTFT, the gateway's queue time;
``--keep`` keeps it). Engine start-up is not measured; every timeout derives from the
measured start of the slowest engine. Run (``--quick``: router_bench's quick workload and
fewer samples, about five minutes on a quiet 2-core machine, engine starts included)::

    python benchmarks/scheduler_bench.py --quick --json
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import host_cpu, percentile
from _runner import Benchmark, Outcome, model_dir_option, run_benchmark
from child_process import free_port
from engine_jobs import load_model_builder
from redis_process import RedisServer
from gateway_process import GatewayProcess
from vllm_served import ROUTER_BIN, Router, ServedEngine
import router_bench as rb
# isort: on

import argparse
import asyncio
import dataclasses
import inspect
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvfabric.spec import KVSpec

SCHED_MAX_RUNNING = 2  # the gateway's in-flight requests on the tenants' engine
TENANT_PROMPT_TOKENS = 64
TENANT_OUTPUT_TOKENS = 16
OVERHEAD_PROMPT_TOKENS = 16
HEAVY_FACTOR = 10  # the heavy tenant's rate over the light one's
HEAVY_LOAD = 1.25  # the heavy tenant's rate over the measured capacity
FAIR_WEIGHTS = {"alice": 3.0, "bob": 1.0}
FAIR_SIZES = {"alice": (64, 16), "bob": (192, 16)}  # (prompt, output) tokens
FAIR_CLIENTS = 3 * SCHED_MAX_RUNNING  # per tenant: more than the gateway runs
FAIR_WARMUP_S = 3.0
BATCH_CLIENTS = 3 * SCHED_MAX_RUNNING
CAPACITY_WARMUP_S, CAPACITY_S = 1.0, 4.0
ROUTING_SEED, SEED = 200, 16
ROUTING_ORDER = ("router", "gateway", "gateway", "router")  # ABBA: drift cancels
GATEWAY_CLASS = "cpu"

TARGETS: dict[str, tuple[str, float]] = {
    "ttft_p50_vs_vllm_router_kv_aware": ("<=", 1.0),
    "proxy_overhead_ms_p50": ("<=", 2.0),
    "light_tenant_p99_ttft_flooded_vs_alone": ("<=", 1.5),
    "fair_share_error": ("<=", 0.1),
    "interactive_p99_ttft_vs_batch": ("<=", 1.0),
}

FIGURES: list[tuple[str, str]] = [
    ("ttft_p50_vs_vllm_router_kv_aware", "client TTFT p50, gateway / vllm-router kv_aware"),
    ("proxy_overhead_ms_p50", "gateway minus direct, small non-streamed request, p50 ms"),
    ("light_tenant_p99_ttft_flooded_vs_alone", "light tenant TTFT p99, heavy flood / alone"),
    ("light_tenant_p99_ttft_flooded_vs_alone_fifo", "the same, both streams as one tenant"),
    ("fair_share_error", "max |served token share - weight share|, backlogged tenants"),
    ("interactive_p99_ttft_vs_batch", "TTFT p99, interactive / batch, mixed backlog"),
    ("ttft_p50_gateway_s", "client TTFT p50, gateway, s"),
    ("ttft_p50_vllm_router_kv_aware_s", "client TTFT p50, vllm-router kv_aware, s"),
    ("ttft_p99_vs_vllm_router_kv_aware", "client TTFT p99, gateway / vllm-router kv_aware"),
    ("hit_token_ratio_gateway", "cached prompt tokens / prompt tokens, gateway"),
    ("hit_token_ratio_vllm_router_kv_aware", "the same, vllm-router kv_aware"),
    ("engine_cache_hit_tokens_gateway", "prompt tokens found in the engine's own cache"),
    ("fabric_loaded_tokens_gateway", "prompt tokens loaded from the fabric (local or pulled)"),
    ("engine_cache_hit_tokens_vllm_router_kv_aware", "the same, vllm-router kv_aware"),
    ("fabric_loaded_tokens_vllm_router_kv_aware", "the same, vllm-router kv_aware"),
    ("requests_per_router", "shared-prefix requests per router (2 x prefixes x repeats)"),
    ("kv_aware_credited_requests", "requests kv_aware credited with a fabric prefix"),
    ("proxy_direct_ms_p50", "the small request straight to the engine, p50 ms"),
    ("proxy_gateway_cpu_ms_per_request", "the gateway's CPU time per such request, ms"),
    ("overhead_pairs", "overhead pairs measured"),
    ("capacity_rps", "tenants' gateway capacity, requests/s (rates derive from it)"),
    ("light_rate_rps", "light tenant's arrival rate, requests/s"),
    ("heavy_rate_rps", "heavy tenant's arrival rate, requests/s"),
    ("light_requests", "light requests per run (alone, flooded, FIFO)"),
    ("heavy_requests", "heavy requests per flooded run"),
    ("light_p99_ttft_alone_s", "light tenant TTFT p99 alone, s"),
    ("light_p99_ttft_flooded_s", "light tenant TTFT p99 flooded, s"),
    ("light_p99_ttft_fifo_s", "light tenant TTFT p99 flooded, one tenant, s"),
    ("fair_window_s", "fair-share window, s"),
    ("fair_backlogged_share", "window dispatches with every tenant queued"),
    ("fair_requests", "requests finished by the fair-share clients"),
    ("interactive_requests", "interactive requests"),
    ("batch_requests", "batch requests sent meanwhile"),
    ("interactive_p99_ttft_s", "interactive TTFT p99, s"),
    ("batch_p99_ttft_s", "batch TTFT p99, s"),
    ("rejected_429", "requests answered 429 (then retried)"),
    ("prefill_tps_prior", "engine 0 prefill tokens/s (the class prior)"),
    ("decode_tps_prior", "engine 0 decode tokens/s (the class prior)"),
    ("prefix_pull_ms", "an engine pulling a prefix from another node, over a local hit, ms"),
    ("link_bytes_per_s_prior", "the gateway's link speed: the prefix's KV bytes / that"),
    ("engine_start_s", "slowest engine start, s (timeouts derive from it)"),
    ("host_cpu", "host CPU (AMX: whether it has it)"),
]


@dataclass(frozen=True)
class Settings:
    routing: rb.Settings
    overhead_pairs: int
    light_requests: int
    fair_window_s: float
    interactive_requests: int


QUICK = Settings(
    rb.QUICK, overhead_pairs=100, light_requests=60, fair_window_s=12.0, interactive_requests=30
)
FULL = Settings(
    rb.FULL, overhead_pairs=300, light_requests=150, fair_window_s=30.0, interactive_requests=80
)


# -- the gateway's configuration ------------------------------------------------------


def kv_spec(builder: Any) -> dict[str, Any]:
    """The gateway's ``fabric`` KV spec of the model router_bench builds (its MODEL over
    build_tiny_llama's defaults), as the engines' connectors derive it."""
    params = inspect.signature(builder.build_tiny_llama).parameters.values()
    model = {p.name: p.default for p in params if p.default is not p.empty} | rb.MODEL
    return {
        "num_layers": model["layers"],
        "num_kv_heads": model["kv_heads"],
        "head_dim": model["head_dim"],
        "dtype": "bfloat16",
    }


def gateway_config(
    engines: Sequence[ServedEngine],
    fabric: dict[str, Any],
    priors: Priors,
    timeout: float,
    max_running: int | None = None,
) -> dict[str, Any]:
    """Engine ``i`` beside node ``node-i`` (router_bench's naming), one hardware class with
    the measured rates, the link at the measured pull speed. No engine pushes: a hand-off
    is the decode engine pulling after the prefill ended, hence ``overlap`` 0."""
    running = {} if max_running is None else {"max_running": max_running}
    return {
        "model": rb.SERVED_NAME,
        "fabric": fabric,
        "classes": {
            GATEWAY_CLASS: {"prefill_tps": priors.prefill_tps, "decode_tps": priors.decode_tps}
        },
        "link": {"bytes_per_s": priors.link_bytes_per_s, "overlap": 0.0},
        "engines": [
            {
                "id": engine.name,
                "url": engine.url,
                "role": "both",
                "node_id": f"node-{i}",
                "hardware_class": GATEWAY_CLASS,
                **running,
            }
            for i, engine in enumerate(engines)
        ],
        "tenants": {
            "weights": {**FAIR_WEIGHTS, "light": 1.0, "heavy": 1.0},
            "max_queued_tokens": 1 << 22,  # no 429 here: the backlogs are the point
        },
        "deadlines": {"request_s": timeout},
    }


def start_gateway(
    root: Path, name: str, config: dict[str, Any], timeout: float, children: list
) -> GatewayProcess:
    gateway = GatewayProcess(name, root / "served", config)
    children.append(gateway)
    gateway.start().wait_ready(timeout)
    return gateway


# -- shared prefixes: gateway vs vllm-router kv_aware ------------------------------------


@dataclass(frozen=True)
class Priors:
    """What the gateway is told about this host, measured before the phases (random prompts
    no phase uses): engine 0's prefill and decode tokens per second (its class prior, which
    the gateway refines) and what an engine's pull of a prefix another node holds costs,
    as the link's bytes per second (its fixed costs folded in)."""

    prefill_tps: float
    decode_tps: float
    link_bytes_per_s: float
    pull_ms: float  # pulling PREFIX_TOKENS, over finding them in the engine's own cache
    pulled_tokens: float  # what the pulling engines took from the fabric (vLLM's count)


def measure_priors(
    engines: Sequence[ServedEngine], fabric: dict[str, Any], timeout: float
) -> Priors:
    rng = random.Random(SEED)

    def seconds(engine: ServedEngine, tokens: list[int], max_tokens: int = 1) -> float:
        return rb.complete(engine.url, tokens, timeout, stream=False, max_tokens=max_tokens)[0]

    def prompt(tokens: int) -> list[int]:
        return rb.random_tokens(rng, tokens)

    first = engines[0]
    seconds(first, prompt(64))  # warm-up
    long = rb.PREFIX_TOKENS + rb.SUFFIX_TOKENS
    prefill_s = min(seconds(first, prompt(long)) for _ in range(2))
    one = min(seconds(first, prompt(64)) for _ in range(2))
    many = min(seconds(first, prompt(64), max_tokens=33) for _ in range(2))
    # a prefix engine 0 computed, found by engine 0 (its own cache) and pulled by another;
    # twice per other engine: the first pull from a peer also opens the connection to it
    pulls, cached = [], 0.0
    for other in [e for e in engines[1:] for _ in range(2)]:
        prefix = prompt(rb.PREFIX_TOKENS)
        seconds(first, prefix + prompt(rb.SUFFIX_TOKENS))
        time.sleep(1.5)  # saved, and announced in the shared index
        local = seconds(first, prefix + prompt(rb.SUFFIX_TOKENS))
        before = other.metric("vllm:prompt_tokens_cached_total")
        pulls.append(seconds(other, prefix + prompt(rb.SUFFIX_TOKENS)) - local)
        cached += other.metric("vllm:prompt_tokens_cached_total") - before
    spec = KVSpec(fabric["num_layers"], fabric["num_kv_heads"], fabric["head_dim"])
    pull_s = max(min(pulls), 1e-3)  # the fastest: a warm connection
    return Priors(
        prefill_tps=round(long / prefill_s),
        decode_tps=round(32 / max(many - one, 1e-3)),
        link_bytes_per_s=round(spec.layout(1).nbytes * rb.PREFIX_TOKENS / pull_s),
        pull_ms=round(1000 * pull_s, 1),
        pulled_tokens=cached / len(pulls),
    )


def warm(url: str, timeout: float) -> None:
    """Two small requests through a freshly started router (not measured)."""
    rng = random.Random(SEED + 1)
    for _ in range(2):
        rb.complete(url, rb.random_tokens(rng, OVERHEAD_PROMPT_TOKENS), timeout, stream=True)


HIT_SOURCES = {  # where the engines found a prompt's cached tokens (vLLM's counters)
    "engine_cache_hit_tokens": "vllm:prefix_cache_hits_total",
    "fabric_loaded_tokens": "vllm:external_prefix_cache_hits_total",
}


def hit_tokens(engines: Sequence[ServedEngine]) -> dict[str, float]:
    return {source: sum(e.metric(name) for e in engines) for source, name in HIT_SOURCES.items()}


def shared_prefixes(
    root: Path,
    engines: Sequence[ServedEngine],
    daemons: Sequence[Any],
    gateway: dict[str, Any],
    settings: rb.Settings,
    timeout: float,
    figures: dict[str, Any],
    children: list,
) -> None:
    router = Router("router-kv_aware", root / "served", free_port(), metrics_port=free_port())
    children.append(router)
    router.start(*rb.router_args("kv_aware", engines, daemons, timeout)).wait_ready(
        timeout, path="/health"
    )
    front = start_gateway(root, "gateway-route", gateway, timeout, children)
    urls = {"router": router.url, "gateway": front.url}
    for url in urls.values():
        warm(url, timeout)
    phases: dict[str, list[rb.Phase]] = {name: [] for name in urls}
    sources = {name: dict.fromkeys(HIT_SOURCES, 0.0) for name in urls}
    for n, name in enumerate(ROUTING_ORDER):  # each phase on prefixes of its own
        prompts = rb.workload(settings, ROUTING_SEED + n)
        before = hit_tokens(engines)
        phases[name].append(rb.run_phase(urls[name], engines, prompts, timeout))
        for source, tokens in hit_tokens(engines).items():
            sources[name][source] += tokens - before[source]
    for name, label in (("router", "vllm_router_kv_aware"), ("gateway", "gateway")):
        for source, tokens in sources[name].items():
            figures[f"{source}_{label}"] = int(tokens)
    router.kill()
    figures["kv_aware_credited_requests"] = rb.credited_requests(router.log_path)
    routed, placed = (
        rb.Phase(
            [t for p in phases[name] for t in p.ttfts],
            sum(p.wall_s for p in phases[name]),
            sum(p.prompt_tokens for p in phases[name]),
            sum(p.cached_tokens for p in phases[name]),
        )
        for name in ("router", "gateway")
    )
    counted = {"kvfabric_gateway_decisions_total": ("mode", "reason")}
    counted["kvfabric_gateway_lookups_total"] = ("outcome",)
    phase: dict[str, dict[str, float]] = {"sum": {}, "count": {}}  # its phases' histogram
    for name, labels, value in front.samples():
        if name in counted:  # e.g. gateway_decisions: {"single/latency": 48}
            key = "/".join(labels.get(label, "") for label in counted[name])
            by = figures.setdefault(name.removeprefix("kvfabric_").removesuffix("_total"), {})
            by[key] = by.get(key, 0) + int(value)
        elif name.startswith("kvfabric_gateway_phase_seconds_"):
            part = phase.get(name.rpartition("_")[2])
            if part is not None:
                part[labels["phase"]] = value
    figures["gateway_phase_ms_mean"] = {
        name: round(1000 * total / phase["count"][name], 1)
        for name, total in phase["sum"].items()
        if phase["count"].get(name)
    }
    front.kill()
    p50 = percentile(placed.ttfts, 50), percentile(routed.ttfts, 50)
    figures.update(
        ttft_p50_vs_vllm_router_kv_aware=round(p50[0] / p50[1], 3),
        ttft_p99_vs_vllm_router_kv_aware=round(
            percentile(placed.ttfts, 99) / percentile(routed.ttfts, 99), 3
        ),
        ttft_p50_gateway_s=round(p50[0], 3),
        ttft_p50_vllm_router_kv_aware_s=round(p50[1], 3),
        hit_token_ratio_gateway=round(placed.hit_ratio, 3),
        hit_token_ratio_vllm_router_kv_aware=round(routed.hit_ratio, 3),
        requests_per_router=len(placed.ttfts),
    )


def proxy_overhead(
    front: GatewayProcess, engine: ServedEngine, pairs: int, timeout: float, figures: dict
) -> None:
    rng = random.Random(SEED + 2)
    direct: list[float] = []
    diffs: list[float] = []
    assert front.child is not None
    cpu_s = 0.0
    for i in range(pairs + 3):  # the first three pairs warm both paths
        if i == 3:
            cpu_s = front.child.cpu_s() or 0.0
        tokens = rb.random_tokens(rng, OVERHEAD_PROMPT_TOKENS)
        urls = [engine.url, front.url][:: 1 if i % 2 else -1]
        took = {url: rb.complete(url, tokens, timeout, stream=False)[0] for url in urls}
        if i >= 3:
            direct.append(took[engine.url])
            diffs.append(took[front.url] - took[engine.url])
    cpu_s = (front.child.cpu_s() or 0.0) - cpu_s  # its health checks included
    figures.update(
        proxy_overhead_ms_p50=round(1000 * percentile(diffs, 50), 2),
        proxy_direct_ms_p50=round(1000 * percentile(direct, 50), 2),
        proxy_gateway_cpu_ms_per_request=round(1000 * cpu_s / pairs, 2),
        overhead_pairs=pairs,
    )


# -- tenants: open and closed loops of streamed requests ---------------------------------


@dataclass(frozen=True)
class Arrival:
    at_s: float
    label: str  # the stream it belongs to (what the figures group by)
    tenant: str
    priority: str
    tokens: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Loop:
    """``clients`` clients each sending its next request as soon as its last one ended."""

    label: str
    tenant: str
    priority: str
    prompt_tokens: int
    max_tokens: int
    clients: int


@dataclass(frozen=True)
class Sample:
    """One answered request, its times in seconds since the load began."""

    label: str
    sent_s: float  # its first try (a 429's wait counts in its TTFT)
    done_s: float
    ttft_s: float
    queue_ms: float  # the gateway's x-kvfabric-queue-ms
    rejections: int

    @property
    def dispatched_s(self) -> float:
        return self.sent_s + self.queue_ms / 1000


@dataclass
class Load:
    """Streamed completions to the gateway at ``url`` from one event loop (many concurrent
    requests cost it little of the two cores); each answered one is a :class:`Sample`."""

    url: str
    timeout: float
    samples: list[Sample] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(
        self,
        client: httpx.AsyncClient,
        label: str,
        tenant: str,
        priority: str,
        tokens: list[int],
        max_tokens: int,
        origin: float,
    ) -> None:
        """One streamed completion, retried after a 429's Retry-After (the TTFT counts from
        the first try); recorded in ``samples``."""
        body = {
            "model": rb.SERVED_NAME,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"X-KVFabric-Tenant": tenant, "X-KVFabric-Priority": priority}
        start, rejections = time.monotonic(), 0
        while True:
            async with client.stream(
                "POST", self.url + "/v1/completions", json=body, headers=headers
            ) as response:
                if response.status_code == 429:
                    rejections += 1
                    await response.aread()
                    retry_s = float(response.headers.get("retry-after", "1"))
                else:
                    if response.status_code != 200:
                        text = (await response.aread()).decode(errors="replace")
                        raise RuntimeError(f"{tenant}: {response.status_code} {text}")
                    queue_ms = float(response.headers.get("x-kvfabric-queue-ms", "nan"))
                    first = 0.0
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[len("data: ") :])
                        if "error" in event:
                            raise RuntimeError(f"{tenant}: stream failed: {event['error']}")
                        choices = event.get("choices") or ()
                        if not first and any(c.get("text") for c in choices):
                            first = time.monotonic() - start
                    if not first:
                        raise RuntimeError(f"{tenant}: no token came back")
                    now = time.monotonic()
                    self.samples.append(
                        Sample(label, start - origin, now - origin, first, queue_ms, rejections)
                    )
                    return
            await asyncio.sleep(retry_s)

    async def run(
        self,
        arrivals: Sequence[Arrival] = (),
        loops: Sequence[Loop] = (),
        until_s: float | None = None,
        during: Callable[[float], Awaitable[None]] | None = None,
    ) -> list[Sample]:
        """Open-loop ``arrivals`` (each sent at its time) and closed ``loops``; the loops
        stop sending once every arrival is answered, or at ``until_s``; ``during(origin)``
        runs alongside (metric readings). Returns every answered request."""
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            origin = time.monotonic()

            async def at(arrival: Arrival) -> None:
                await asyncio.sleep(max(0.0, origin + arrival.at_s - time.monotonic()))
                await self.send(
                    client,
                    arrival.label,
                    arrival.tenant,
                    arrival.priority,
                    arrival.tokens,
                    arrival.max_tokens,
                    origin,
                )

            async def client_loop(loop: Loop, seed: int) -> None:
                rng = random.Random(seed)
                while not self.stop.is_set():
                    tokens = rb.random_tokens(rng, loop.prompt_tokens)
                    await self.send(
                        client,
                        loop.label,
                        loop.tenant,
                        loop.priority,
                        tokens,
                        loop.max_tokens,
                        origin,
                    )

            async def stopper() -> None:
                if arrivals:
                    await asyncio.gather(*(at(a) for a in arrivals))
                if until_s is not None:
                    await asyncio.sleep(max(0.0, origin + until_s - time.monotonic()))
                self.stop.set()

            looping = [
                client_loop(loop, SEED + 1000 * n + c)
                for n, loop in enumerate(loops)
                for c in range(loop.clients)
            ]
            extra = [during(origin)] if during is not None else []
            await asyncio.gather(stopper(), *looping, *extra)
        return self.samples


def poisson(rng: random.Random, rate: float, count: int | None = None, until_s: float = 0.0):
    """Arrival times of a Poisson stream of ``rate`` per second: ``count`` of them, or all
    before ``until_s``."""
    times, now = [], 0.0
    while True:
        now += rng.expovariate(rate)
        if (count is not None and len(times) == count) or (count is None and now > until_s):
            return times
        times.append(now)


def ttfts(samples: Sequence[Sample], label: str, after_s: float = 0.0) -> list[float]:
    return [s.ttft_s for s in samples if s.label == label and s.sent_s >= after_s]


def drive(url: str, timeout: float, log: Path, **kwargs: Any) -> list[Sample]:
    """:meth:`Load.run`'s samples, also written to ``log`` (JSON, in the work directory)."""
    samples = asyncio.run(Load(url, timeout).run(**kwargs))
    log.write_text(json.dumps([dataclasses.asdict(s) for s in samples]))
    return samples


def capacity(url: str, timeout: float, logs: Path) -> float:
    """Requests per second the tenants' gateway answers with every slot busy (closed loop)."""
    loop = Loop(
        "calib",
        "calib",
        "interactive",
        TENANT_PROMPT_TOKENS,
        TENANT_OUTPUT_TOKENS,
        clients=2 * SCHED_MAX_RUNNING,
    )
    samples = drive(
        url,
        timeout,
        logs / "samples-capacity.json",
        loops=[loop],
        until_s=CAPACITY_WARMUP_S + CAPACITY_S,
    )
    end = CAPACITY_WARMUP_S + CAPACITY_S
    return sum(CAPACITY_WARMUP_S <= s.done_s < end for s in samples) / CAPACITY_S


def isolation(
    url: str, mu: float, settings: Settings, timeout: float, figures: dict, logs: Path
) -> int:
    """The light tenant alone, flooded (two tenants), flooded FIFO (one tenant); the
    requests answered 429."""
    heavy_rate = HEAVY_LOAD * mu
    light_rate = heavy_rate / HEAVY_FACTOR
    rng = random.Random(SEED + 3)
    light_at = poisson(rng, light_rate, count=settings.light_requests)
    heavy_at = poisson(rng, heavy_rate, until_s=light_at[-1])
    light = [rb.random_tokens(rng, TENANT_PROMPT_TOKENS) for _ in light_at]
    heavy = [rb.random_tokens(rng, TENANT_PROMPT_TOKENS) for _ in heavy_at]

    def arrivals(light_tenant: str, heavy_tenant: str | None) -> list[Arrival]:
        out = [
            Arrival(t, "light", light_tenant, "interactive", p, TENANT_OUTPUT_TOKENS)
            for t, p in zip(light_at, light, strict=True)
        ]
        if heavy_tenant is not None:
            out += [
                Arrival(t, "heavy", heavy_tenant, "interactive", p, TENANT_OUTPUT_TOKENS)
                for t, p in zip(heavy_at, heavy, strict=True)
            ]
        return out

    runs = {
        "alone": drive(url, timeout, logs / "samples-alone.json", arrivals=arrivals("light", None)),
        "flooded": drive(
            url, timeout, logs / "samples-flooded.json", arrivals=arrivals("light", "heavy")
        ),
        "fifo": drive(
            url, timeout, logs / "samples-fifo.json", arrivals=arrivals("shared", "shared")
        ),
    }
    p99 = {name: percentile(ttfts(samples, "light"), 99) for name, samples in runs.items()}
    figures.update(
        light_tenant_p99_ttft_flooded_vs_alone=round(p99["flooded"] / p99["alone"], 3),
        light_tenant_p99_ttft_flooded_vs_alone_fifo=round(p99["fifo"] / p99["alone"], 3),
        light_p99_ttft_alone_s=round(p99["alone"], 3),
        light_p99_ttft_flooded_s=round(p99["flooded"], 3),
        light_p99_ttft_fifo_s=round(p99["fifo"], 3),
        light_rate_rps=round(light_rate, 2),
        heavy_rate_rps=round(heavy_rate, 2),
        light_requests=len(light_at),
        heavy_requests=len(heavy_at),
        heavy_p50_ttft_flooded_s=round(percentile(ttfts(runs["flooded"], "heavy"), 50), 3),
        light_p99_queue_ms={  # the gateway's x-kvfabric-queue-ms: waiting in its queue
            name: round(percentile([s.queue_ms for s in samples if s.label == "light"], 99), 1)
            for name, samples in runs.items()
        },
    )
    return sum(s.rejections for samples in runs.values() for s in samples)


def fair_share(
    front: GatewayProcess, settings: Settings, timeout: float, figures: dict, logs: Path
) -> int:
    tenants = sorted(FAIR_WEIGHTS)
    start, end = FAIR_WARMUP_S, FAIR_WARMUP_S + settings.fair_window_s
    served: list[dict[str, float]] = []

    def read() -> dict[str, float]:
        return {t: front.metric("kvfabric_gateway_served_tokens_total", tenant=t) for t in tenants}

    async def during(origin: float) -> None:
        for at in (start, end):
            await asyncio.sleep(max(0.0, origin + at - time.monotonic()))
            served.append(await asyncio.to_thread(read))

    loops = [Loop(t, t, "interactive", *FAIR_SIZES[t], clients=FAIR_CLIENTS) for t in tenants]
    samples = drive(
        front.url, timeout, logs / "samples-fair.json", loops=loops, until_s=end, during=during
    )
    tokens = {t: served[1][t] - served[0][t] for t in tenants}
    total, weight = sum(tokens.values()), sum(FAIR_WEIGHTS.values())
    error = max(abs(tokens[t] / total - FAIR_WEIGHTS[t] / weight) for t in tenants)
    # backlogged: at each dispatch in the window, every tenant had a request sent and not
    # yet dispatched (the gateway's x-kvfabric-queue-ms)
    dispatches = [s.dispatched_s for s in samples if start <= s.dispatched_s < end]
    backlogged = sum(
        all(any(s.sent_s <= d <= s.dispatched_s for s in samples if s.label == t) for t in tenants)
        for d in dispatches
    )
    figures.update(
        fair_share_error=round(error, 4),
        fair_served_tokens={t: int(v) for t, v in tokens.items()},
        fair_weights=FAIR_WEIGHTS,
        fair_window_s=settings.fair_window_s,
        fair_backlogged_share=round(backlogged / max(len(dispatches), 1), 3),
        fair_requests={t: len(ttfts(samples, t)) for t in tenants},
    )
    return sum(s.rejections for s in samples)


def priorities(
    url: str, mu: float, settings: Settings, timeout: float, figures: dict, logs: Path
) -> int:
    rng = random.Random(SEED + 4)
    start_s = 1.0  # the batch backlog forms first
    arrivals = [
        Arrival(
            start_s + t,
            "interactive",
            "mixed",
            "interactive",
            rb.random_tokens(rng, TENANT_PROMPT_TOKENS),
            TENANT_OUTPUT_TOKENS,
        )
        for t in poisson(rng, mu / 4, count=settings.interactive_requests)
    ]
    batch = Loop(
        "batch", "mixed", "batch", TENANT_PROMPT_TOKENS, TENANT_OUTPUT_TOKENS, clients=BATCH_CLIENTS
    )
    samples = drive(url, timeout, logs / "samples-priority.json", arrivals=arrivals, loops=[batch])
    interactive, batched = ttfts(samples, "interactive"), ttfts(samples, "batch", start_s)
    p99 = percentile(interactive, 99), percentile(batched, 99)
    figures.update(
        interactive_p99_ttft_vs_batch=round(p99[0] / p99[1], 3),
        interactive_p99_ttft_s=round(p99[0], 3),
        batch_p99_ttft_s=round(p99[1], 3),
        interactive_requests=len(interactive),
        batch_requests=len(batched),
    )
    return sum(s.rejections for s in samples)


def tenants(
    root: Path,
    engine: ServedEngine,
    config: dict[str, Any],
    settings: Settings,
    timeout: float,
    figures: dict[str, Any],
    children: list,
) -> None:
    front = start_gateway(root, "gateway-tenants", config, timeout, children)
    proxy_overhead(front, engine, settings.overhead_pairs, timeout, figures)
    mu = capacity(front.url, timeout, root)
    figures["capacity_rps"] = round(mu, 2)
    rejected = isolation(front.url, mu, settings, timeout, figures, root)
    rejected += fair_share(front, settings, timeout, figures, root)
    rejected += priorities(front.url, mu, settings, timeout, figures, root)
    figures["rejected_429"] = rejected
    front.kill()


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    if not ROUTER_BIN.exists():
        raise SystemExit("vllm-router is not installed: tests/install.sh installs it")
    settings = QUICK if args.quick else FULL
    builder = load_model_builder()
    model = builder.build_tiny_llama(args.model_dir or root / "model", **rb.MODEL)
    figures: dict[str, Any] = {"host_cpu": host_cpu()}
    children: list = []
    try:
        redis = RedisServer(root).start()
        children.append(redis)
        cluster = [
            "cluster.index=redis",
            f"cluster.redis_url={redis.url}",
            "cluster.heartbeat_s=0.5",
            "tcp.port=0",
            "cluster.transport=socket",
        ]
        daemons, engines, start_s = rb.start_nodes(root, model, children, cluster)
        figures["engine_start_s"] = round(start_s, 1)
        timeout = 4 * start_s
        fabric = {"url": daemons[0].http_url, **kv_spec(builder)}
        priors = measure_priors(engines, fabric, timeout)
        figures.update(
            prefill_tps_prior=priors.prefill_tps,
            decode_tps_prior=priors.decode_tps,
            link_bytes_per_s_prior=priors.link_bytes_per_s,
            prefix_pull_ms=priors.pull_ms,
            prefix_pull_cached_tokens=priors.pulled_tokens,
        )
        shared_prefixes(
            root,
            engines,
            daemons,
            gateway_config(engines, fabric, priors, timeout),
            settings.routing,
            timeout,
            figures,
            children,
        )
        config = gateway_config(engines[:1], fabric, priors, timeout, SCHED_MAX_RUNNING)
        tenants(root, engines[0], config, settings, timeout, figures, children)
    finally:
        for child in reversed(children):
            child.kill()
    return Outcome(figures)


BENCH = Benchmark(
    __doc__,
    "kvfabric-scheduler-bench-",
    TARGETS,
    FIGURES,
    quick_help=f"router_bench's quick workload ({rb.QUICK.prefixes} prefixes x "
    f"{rb.QUICK.repeats} repeats), {QUICK.light_requests} light requests",
    add_arguments=model_dir_option,
    keep_option=True,
)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
