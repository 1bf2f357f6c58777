"""Router benchmark: vllm-router's kv_aware on fabric events vs round robin and cache_aware.

Real parts only: vLLM CPU OpenAI servers (``python -m vllm.entrypoints.openai.api_server``,
what ``vllm serve`` runs) of the tests' random-weight tiny Llama built locally
(tests/models/build_tiny_llama.py), each with
KVFabricConnector (``kv_both``) on a node daemon of its own (``kvfabric serve``), and the
``vllm-router`` binary of its wheel.

**Routing.** ``ENGINES`` engines; each node's daemon publishes its inventory as vLLM KV
events (``kv_events.endpoint`` on loopback, with replay) and the router subscribes to them
(``--kv-event-source <engine URL>=<its daemon's stream>``, 16-token blocks). The nodes share
no global index: what one node's fabric holds only its own engine can load, so where a
request goes decides whether its prefix is a hit. The workload: ``prefixes`` long shared
prefixes (``PREFIX_TOKENS`` random tokens) with distinct ``SUFFIX_TOKENS``-token suffixes,
``repeats`` requests per prefix, in an order shuffled with a fixed seed, sent by
``CONCURRENCY`` concurrent clients as token-id prompts (greedy, ``OUTPUT_TOKENS`` tokens,
streamed: the client's TTFT is the time to the first streamed token). Each policy runs
the same arrival order of prefixes (one shuffle) on prefixes of its own (other random
tokens), so none inherits another's caches and none gets an easier order; the router is
restarted between policies, the engines and daemons are not.

The hit ratio's ceiling is ``(repeats - 1) / repeats * PREFIX_TOKENS / prompt tokens``: a
prefix's first request computes it wherever it goes. Any router fed by events also misses a
repeat that arrives before the first one's prefill began (the clients start
``CONCURRENCY`` requests at once), and vllm-router's kv_aware weighs a worker's queued
prefill tokens against the prefix it credits, so a repeat that arrives while its prefix is
still being computed may go to an idle engine. Hence 12 repeats per prefix (ceiling 0.889):
with 6 the ceiling is 0.808 and two early misses put any event-fed router under 0.8.

- ``ttft_p50_kv_aware_vs_round_robin`` / ``..._p99_...``: client TTFT percentiles, kv_aware
  over round robin (target p50 <= 0.5);
- ``throughput_kv_aware_vs_round_robin``: completed requests per second over the phase's
  wall time, kv_aware over round robin (target >= 1.3);
- ``hit_token_ratio_kv_aware``: prompt tokens the engines did not compute (vLLM's
  ``vllm:prompt_tokens_cached``: its own prefix cache and the fabric's loads) over prompt
  tokens (``vllm:prompt_tokens``), summed over the engines during the kv_aware phase
  (target >= 0.8); the same for the other policies is reported;
- ``cache_aware_vs_kv_aware_ttft_p50``: the router's approximate tree of its own routing
  history (``cache_aware``, no events) against fabric events.

**P/D.** Two more daemons sharing a Redis index, a ``kv_producer`` and a ``kv_consumer``
engine, and the router in its vLLM PD mode (``--vllm-pd-disaggregation``, ``--kv-connector
nixl``: README "Behind a router"); ``pd_outputs_identical``: the greedy output of every
P/D request (prompts of ``PD_PROMPT_TOKENS`` tokens) equals the same prompt run on one of
the routing engines directly, which computes it (a prompt no fabric holds).

Engine start-up is not measured; every timeout derives from the measured start of the
slowest engine. Run (``--quick``: fewer prefixes, about ten minutes on a quiet
2-core machine; without it about twice that)::

    python benchmarks/router_bench.py --quick --json
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import percentile
from _runner import Benchmark, Outcome, model_dir_option, run_benchmark
from child_process import free_port
from daemon_process import DaemonProcess
from engine_jobs import kvfabric_connector, load_model_builder
from redis_process import RedisServer
from vllm_served import ROUTER_BIN, Router, ServedEngine
# isort: on

import argparse
import json
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL = {"vocab": 2048}  # build_tiny_llama's defaults otherwise: 4 layers, hidden 256
SERVED_NAME = "bench"
ENGINES = 3
PREFIX_TOKENS = 2048  # 8 fabric chunks of 256
SUFFIX_TOKENS = 64
OUTPUT_TOKENS = 4
CONCURRENCY = 3
EVENT_BLOCK_SIZE = 16
PD_PROMPT_TOKENS = (1024, 2000, 3000)
ENGINE_START_LIMIT_S = 900.0  # a cold first vLLM import on a loaded 2-core machine
DAEMON = ["store.tiers.dram.capacity=2GiB", "store.tiers.ssd.capacity=2GiB"]
POLICIES = ("round_robin", "kv_aware", "cache_aware")

TARGETS: dict[str, tuple[str, float]] = {
    "ttft_p50_kv_aware_vs_round_robin": ("<=", 0.5),
    "throughput_kv_aware_vs_round_robin": (">=", 1.3),
    "hit_token_ratio_kv_aware": (">=", 0.8),
    "pd_outputs_identical": (">=", 1),
}

FIGURES: list[tuple[str, str]] = [
    ("ttft_p50_kv_aware_vs_round_robin", "client TTFT p50, kv_aware / round robin"),
    ("ttft_p99_kv_aware_vs_round_robin", "client TTFT p99, kv_aware / round robin"),
    ("throughput_kv_aware_vs_round_robin", "requests per second, kv_aware / round robin"),
    ("hit_token_ratio_kv_aware", "cached prompt tokens / prompt tokens, kv_aware"),
    ("hit_token_ratio_round_robin", "the same, round robin"),
    ("hit_token_ratio_cache_aware", "the same, cache_aware"),
    ("cache_aware_vs_kv_aware_ttft_p50", "client TTFT p50, cache_aware / kv_aware"),
    ("pd_outputs_identical", "P/D behind the router equals a monolithic engine"),
    ("ttft_p50_kv_aware_s", "client TTFT p50, kv_aware, s"),
    ("ttft_p50_round_robin_s", "client TTFT p50, round robin, s"),
    ("ttft_p50_cache_aware_s", "client TTFT p50, cache_aware, s"),
    ("throughput_kv_aware_rps", "requests per second, kv_aware"),
    ("throughput_round_robin_rps", "requests per second, round robin"),
    ("requests_per_policy", "requests per policy (prefixes x repeats)"),
    ("kv_aware_credited_requests", "requests kv_aware credited with a fabric prefix"),
    ("pd_requests", "P/D requests compared"),
    ("engine_start_s", "slowest engine start, s (timeouts derive from it)"),
]


@dataclass(frozen=True)
class Settings:
    prefixes: int
    repeats: int


QUICK = Settings(prefixes=4, repeats=12)
FULL = Settings(prefixes=8, repeats=12)
ORDER_SEED = 14  # one arrival order of prefixes for every policy


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, MODEL["vocab"]) for _ in range(count)]


def workload(settings: Settings, seed: int) -> list[list[int]]:
    """``prefixes`` x ``repeats`` prompts (a shared prefix, a distinct suffix) of tokens drawn
    with ``seed``, in the arrival order every seed shares (:data:`ORDER_SEED`)."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, PREFIX_TOKENS) for _ in range(settings.prefixes)]
    order = [p for p in range(settings.prefixes) for _ in range(settings.repeats)]
    random.Random(ORDER_SEED).shuffle(order)
    return [prefixes[p] + random_tokens(rng, SUFFIX_TOKENS) for p in order]


def complete(
    url: str, tokens: list[int], timeout: float, stream: bool, max_tokens: int = OUTPUT_TOKENS
) -> tuple[float, list[int]]:
    """Streamed: (seconds to the first token, []); not streamed: (seconds, the generated
    token ids). A streamed request does not ask for token ids: vllm-router 0.1.17's
    ``kv_aware`` credits no cached prefix to a request with ``return_token_ids``."""
    body = {
        "model": SERVED_NAME,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    start = time.monotonic()
    if not stream:
        body["return_token_ids"] = True
        response = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        response.raise_for_status()
        return time.monotonic() - start, response.json()["choices"][0]["token_ids"]
    first = 0.0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: ") :]).get("choices") or ()
            if not first and any(c.get("text") for c in choices):
                first = time.monotonic() - start
    assert first, "no token came back"
    return first, []


@dataclass
class Phase:
    ttfts: list[float]
    wall_s: float
    prompt_tokens: float
    cached_tokens: float

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def rps(self) -> float:
        return len(self.ttfts) / self.wall_s


def engine_tokens(engines: Sequence[ServedEngine]) -> tuple[float, float]:
    return (
        sum(e.metric("vllm:prompt_tokens_total") for e in engines),
        sum(e.metric("vllm:prompt_tokens_cached_total") for e in engines),
    )


def run_phase(
    url: str, engines: Sequence[ServedEngine], prompts: list[list[int]], timeout: float
) -> Phase:
    """``prompts`` sent to ``url`` (a router's, or anything OpenAI-compatible in front of
    ``engines``) by ``CONCURRENCY`` clients, streamed; the engines' prompt tokens and cached
    tokens counted over the phase."""
    before = engine_tokens(engines)
    ttfts: list[float] = []
    lock = threading.Lock()

    def one(tokens: list[int]) -> None:
        ttft, _ = complete(url, tokens, timeout, stream=True)
        with lock:
            ttfts.append(ttft)

    start = time.monotonic()
    pool = ThreadPoolExecutor(CONCURRENCY)
    try:
        for future in [pool.submit(one, p) for p in prompts]:
            future.result()
    finally:  # stopped: the caller kills the engines, which ends the requests in flight
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.monotonic() - start
    after = engine_tokens(engines)
    return Phase(ttfts, wall, after[0] - before[0], after[1] - before[1])


def credited_requests(log: Path) -> int:
    """Requests the kv_aware router credited with a cached prefix (its debug decision log;
    ANSI colours stripped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    found = re.findall(r"KV prefix decision.*?credited_prefix_tokens=(\d+)", text)
    return sum(int(tokens) > 0 for tokens in found)


def start_engines(starts: list[Callable[[], ServedEngine]]) -> tuple[list[ServedEngine], float]:
    """Start every engine at once; (engines, the slowest start's seconds)."""
    engines = [start() for start in starts]
    slowest = max(engine.wait_ready(ENGINE_START_LIMIT_S) for engine in engines)
    return engines, slowest


def start_nodes(
    root: Path, model: Path, children: list, cluster: Sequence[str] = ()
) -> tuple[list[DaemonProcess], list[ServedEngine], float]:
    """``ENGINES`` node daemons publishing their inventory as KV events (``cluster``: more
    ``--set`` items for each, e.g. a shared index) and a served engine on each; (daemons,
    engines, the slowest engine's start in seconds). Every child goes into ``children``."""
    daemons = []
    for i in range(ENGINES):
        daemon = DaemonProcess(
            root / f"node-{i}",
            [
                *DAEMON,
                f"node_id=node-{i}",
                "kv_events.endpoint=tcp://127.0.0.1:*",
                "kv_events.replay_endpoint=tcp://127.0.0.1:*",
                f"kv_events.block_size={EVENT_BLOCK_SIZE}",
                *cluster,
            ],
        ).start()
        children.append(daemon)
        daemons.append(daemon)
    served = [ServedEngine(f"engine-{i}", root / "served", free_port()) for i in range(ENGINES)]
    children += served
    engines, start_s = start_engines(
        [
            lambda e=e, d=d: e.start(model, SERVED_NAME, kvfabric_connector(d.socket))
            for e, d in zip(served, daemons, strict=True)
        ]
    )
    return daemons, engines, start_s


def router_args(
    policy: str,
    engines: Sequence[ServedEngine],
    daemons: Sequence[DaemonProcess],
    timeout: float,
) -> list[str]:
    """vllm-router's arguments for ``policy`` over ``engines``; ``kv_aware`` subscribes to
    each engine's daemon's KV events (and their replay) and logs its decisions."""
    args = ["--worker-urls", *(e.url for e in engines), "--policy", policy]
    args += [
        "--worker-startup-check-interval",
        "1",
        "--request-timeout-secs",
        str(int(timeout)),
    ]
    if policy == "kv_aware":
        args += [
            "--log-level",
            "debug",  # its decisions: credited_prefix_tokens per request
            "--kv-event-model",
            SERVED_NAME,
            "--kv-event-block-size",
            str(EVENT_BLOCK_SIZE),
        ]
        for engine, daemon in zip(engines, daemons, strict=True):
            args += ["--kv-event-source", f"{engine.url}={daemon.info['kv_events_endpoint']}"]
            args += [
                "--kv-event-replay-source",
                f"{engine.url}={daemon.info['kv_events_replay_endpoint']}",
            ]
    return args


def routing(
    root: Path,
    model: Path,
    settings: Settings,
    figures: dict[str, object],
    children: list,
) -> None:
    daemons, engines, start_s = start_nodes(root, model, children)
    figures["engine_start_s"] = round(start_s, 1)
    timeout = 4 * start_s
    phases: dict[str, Phase] = {}
    for n, policy in enumerate(POLICIES):
        router = Router(f"router-{policy}", root / "served", free_port(), metrics_port=free_port())
        children.append(router)
        router.start(*router_args(policy, engines, daemons, timeout)).wait_ready(
            timeout, path="/health"
        )
        phases[policy] = run_phase(router.url, engines, workload(settings, seed=100 + n), timeout)
        router.kill()
        if policy == "kv_aware":
            figures["kv_aware_credited_requests"] = credited_requests(router.log_path)
    kv, rr, cache = phases["kv_aware"], phases["round_robin"], phases["cache_aware"]
    p50 = {name: percentile(p.ttfts, 50) for name, p in phases.items()}
    figures.update(
        ttft_p50_kv_aware_vs_round_robin=round(p50["kv_aware"] / p50["round_robin"], 3),
        ttft_p99_kv_aware_vs_round_robin=round(
            percentile(kv.ttfts, 99) / percentile(rr.ttfts, 99), 3
        ),
        throughput_kv_aware_vs_round_robin=round(kv.rps / rr.rps, 3),
        hit_token_ratio_kv_aware=round(kv.hit_ratio, 3),
        hit_token_ratio_round_robin=round(rr.hit_ratio, 3),
        hit_token_ratio_cache_aware=round(cache.hit_ratio, 3),
        cache_aware_vs_kv_aware_ttft_p50=round(p50["cache_aware"] / p50["kv_aware"], 3),
        ttft_p50_kv_aware_s=round(p50["kv_aware"], 3),
        ttft_p50_round_robin_s=round(p50["round_robin"], 3),
        ttft_p50_cache_aware_s=round(p50["cache_aware"], 3),
        throughput_kv_aware_rps=round(kv.rps, 3),
        throughput_round_robin_rps=round(rr.rps, 3),
        requests_per_policy=settings.prefixes * settings.repeats,
    )
    figures["_reference_engine"] = engines[0]


def pd(root: Path, model: Path, reference: ServedEngine, figures: dict, children: list) -> None:
    redis = RedisServer(root).start()
    children.append(redis)
    nodes = []
    for name in ("prefill-0", "decode-0"):
        daemon = DaemonProcess(
            root / name,
            [
                *DAEMON,
                f"node_id={name}",
                "cluster.index=redis",
                f"cluster.redis_url={redis.url}",
                "cluster.heartbeat_s=0.2",
                "tcp.port=0",
                "cluster.transport=socket",
            ],
        ).start()
        children.append(daemon)
        nodes.append(daemon)
    prefill = ServedEngine("pd-prefill", root / "served", free_port())
    decode = ServedEngine("pd-decode", root / "served", free_port())
    children += [prefill, decode]
    _, start_s = start_engines(
        [
            lambda: prefill.start(
                model, SERVED_NAME, kvfabric_connector(nodes[0].socket, "kv_producer")
            ),
            lambda: decode.start(
                model, SERVED_NAME, kvfabric_connector(nodes[1].socket, "kv_consumer")
            ),
        ]
    )
    timeout = 4 * start_s
    router = Router("router-pd", root / "served", free_port(), metrics_port=free_port())
    children.append(router)
    router.start(
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--kv-connector",
        "nixl",
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
        "--request-timeout-secs",
        str(int(timeout)),
    ).wait_ready(timeout, path="/health")
    rng = random.Random(7)
    same = 0
    for length in PD_PROMPT_TOKENS:
        tokens = random_tokens(rng, length)
        _, through_router = complete(router.url, tokens, timeout, stream=False)
        _, direct = complete(reference.url, tokens, timeout, stream=False)
        same += through_router == direct
    figures["pd_outputs_identical"] = same == len(PD_PROMPT_TOKENS)
    figures["pd_requests"] = len(PD_PROMPT_TOKENS)


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    if not ROUTER_BIN.exists():
        raise SystemExit("vllm-router is not installed: tests/install.sh installs it")
    settings = QUICK if args.quick else FULL
    model_dir = args.model_dir or root / "model"
    model = load_model_builder().build_tiny_llama(model_dir, **MODEL)
    figures: dict[str, object] = {}
    children: list = []
    try:
        routing(root, model, settings, figures, children)
        reference = figures.pop("_reference_engine")
        assert isinstance(reference, ServedEngine)
        pd(root, model, reference, figures, children)
    finally:
        for child in reversed(children):
            child.kill()
    return Outcome(figures)


BENCH = Benchmark(
    __doc__,
    "kvfabric-router-bench-",
    TARGETS,
    FIGURES,
    quick_help=f"{QUICK.prefixes} prefixes x {QUICK.repeats} repeats instead of "
    f"{FULL.prefixes} x {FULL.repeats}",
    add_arguments=model_dir_option,
    keep_option=True,
)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
