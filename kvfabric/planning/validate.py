"""The simulator against a real cluster: calibrate, drive, simulate, compare.

Given running vLLM engines (all of one class, each role ``both``, declared without a
``node_id``: every request runs on one engine; each engine's compute thread on a core of its
own: ``VLLM_CPU_OMP_THREADS_BIND``, as vLLM's automatic binding puts them all on one) behind
a kvfabric gateway
(:mod:`kvfabric.gateway`, with ``max_running`` slots per engine), :func:`validate`

1. warms every engine (an engine's first prefill of a shape and first decode of a batch
   size cost more) and calibrates the class one request or batch at a time
   (:func:`kvfabric.planning.calibrate.calibrate`, through the gateway: what a request pays
   around the engine's steps is part of what the mix sees) after a first mix through the
   gateway (a seed of its own: engines on a small CPU host keep getting faster over their
   first minute); with the engines' process groups, it also measures how many cores each
   keeps busy while it serves (:mod:`kvfabric.planning.footprint`: the API server and the
   engine core burn CPU beside the model runner) over that mix and the calibration;
2. draws a request mix (Poisson arrivals at ``load`` of what the calibrated engines can
   serve, uniform prompt and output lengths) and sends it through the gateway at those
   times, streamed, greedy, ``ignore_eos`` (every output has exactly its drawn length),
   timing each request's first token and its last at the client;
3. simulates the same requests (same arrival times and lengths) on the same cluster
   (:func:`kvfabric.sim.cluster.simulate`: engines of the measured footprint, one thread
   without process groups, on a host of ``host_cores``, which slow each other down only
   when they keep more cores busy at once than it has);
4. reports measured and simulated TTFT p50 / p99 and TPOT p50, and each one's relative error
   ``|simulated - measured| / measured``.

Blocking; the caller owns the processes. A request that fails raises
:class:`~kvfabric.planning.calibrate.CalibrationError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from kvfabric.planning import footprint
from kvfabric.planning.calibrate import (
    DECODE_BATCHES,
    PREFILL_SIZES,
    CalibrationError,
    calibrate,
    carries_choices,
    warm,
)
from kvfabric.sched.model import Link, Role
from kvfabric.sim.cluster import ClusterSpec, EngineSpec, simulate
from kvfabric.sim.engine import EngineProfile
from kvfabric.sim.results import SimResult
from kvfabric.sim.workload import Lengths, Phase, SimRequest, Workload, generate

CLASS = "measured"
QUICK_PREFILL_SIZES = (16, 128, 512)
QUICK_BATCHES = (1, 4)
PROMPTS = Lengths("uniform", low=32, high=512)
OUTPUTS = Lengths("uniform", low=8, high=48)


@dataclass(frozen=True)
class Figures:
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float


@dataclass(frozen=True)
class Validation:
    profile: EngineProfile
    rate_rps: float
    drawn: tuple[SimRequest, ...]  # what was sent, at these times
    engines: int
    max_running: int
    host_cores: float
    measured: Figures
    samples: tuple[tuple[float, float], ...]  # per request sent: (TTFT, TPOT), measured

    @property
    def simulated(self) -> Figures:
        return self.simulate(self.profile)

    def run(self, profile: EngineProfile | None = None) -> SimResult:
        """This run's requests simulated on engines of ``profile`` (default: the calibrated
        one; another shows how sensitive the comparison is)."""
        cluster = ClusterSpec(
            tuple(
                EngineSpec(
                    f"e{i}",
                    CLASS,
                    Role.BOTH,
                    host="host",
                    max_running=self.max_running,
                    on_fabric=False,
                )
                for i in range(self.engines)
            ),
            {CLASS: profile or self.profile},
            Link(1e9, 0),
            hosts={"host": self.host_cores},
        )
        return simulate(cluster, self.drawn)

    def simulate(self, profile: EngineProfile) -> Figures:
        sim = self.run(profile).summary()
        return Figures(sim.ttft_p50_s, sim.ttft_p99_s, sim.tpot_p50_s)

    def error(self, name: str, simulated: Figures | None = None) -> float:
        m: float = getattr(self.measured, name)
        s: float = getattr(simulated or self.simulated, name)
        return abs(s - m) / m


def validate(
    engine_urls: Sequence[str],
    gateway_url: str,
    model: str,
    *,
    vocab: int,
    max_running: int,
    host_cores: float,
    prompt: Lengths = PROMPTS,
    output: Lengths = OUTPUTS,
    load: float = 0.5,
    count: int = 120,
    seed: int = 0,
    timeout_s: float = 300.0,
    quick: bool = False,
    process_groups: Sequence[int] = (),
) -> Validation:
    """``quick``: a calibration of fewer points (a test's budget); ``process_groups``: the
    engines' (each served in a group of its own), for their footprint."""
    for url in engine_urls:  # an engine's first requests pay one-time costs
        warm(url, model, vocab, timeout_s)
    # a first mix through the gateway (a seed of its own, at a guessed rate): engines on a
    # small CPU host keep getting faster over their first minute; calibrate after it
    before = footprint.snapshot(process_groups)
    asyncio.run(
        _drive(
            gateway_url, model, _mix(2.0, prompt, output, 30, seed + 1), vocab, seed + 1, timeout_s
        )
    )
    # through the gateway, streamed like the mix: what a request pays around the engine's
    # steps (HTTP, SSE relayed twice, the client) belongs to the class as the mix sees it
    profile = calibrate(
        gateway_url,
        model,
        CLASS,
        vocab=vocab,
        timeout_s=timeout_s,
        prefill_sizes=QUICK_PREFILL_SIZES if quick else PREFILL_SIZES,
        batches=QUICK_BATCHES if quick else DECODE_BATCHES,
        repeats=2 if quick else 3,
    ).profile
    threads = footprint.threads_between(before, footprint.snapshot(process_groups))
    if threads is not None:
        profile = dataclasses.replace(profile, threads=threads)
    per_request = profile.step_s(round(prompt.expected()), 0) + output.expected() * profile.step_s(
        0, 1
    )
    rate = load * len(engine_urls) / per_request
    requests = _mix(rate, prompt, output, count, seed)
    measured = asyncio.run(_drive(gateway_url, model, requests, vocab, seed, timeout_s))
    return Validation(
        profile,
        rate,
        tuple(requests),
        len(engine_urls),
        max_running,
        host_cores,
        _figures(measured),
        tuple(measured),
    )


def _mix(rate: float, prompt: Lengths, output: Lengths, count: int, seed: int) -> list[SimRequest]:
    return generate(Workload((Phase(rate, count / rate, prompt, output),)), seed)


def _figures(times: list[tuple[float, float]]) -> Figures:
    ttft = [t for t, _ in times]
    tpot = [p for _, p in times if p == p]  # NaN: one-token outputs
    return Figures(
        float(np.percentile(ttft, 50)),
        float(np.percentile(ttft, 99)),
        float(np.percentile(tpot, 50)),
    )


async def _drive(
    url: str, model: str, requests: list[SimRequest], vocab: int, seed: int, timeout: float
) -> list[tuple[float, float]]:
    """Each request at its arrival time; (TTFT, TPOT) per request, in order."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(r.prompt_tokens)] for r in requests]
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        origin = time.perf_counter()

        async def one(r: SimRequest, tokens: list[int]) -> tuple[float, float]:
            await asyncio.sleep(max(0.0, origin + r.arrival_s - time.perf_counter()))
            sent = time.perf_counter()
            body = {
                "model": model,
                "prompt": tokens,
                "max_tokens": r.output_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
            }
            first = last = 0.0
            async with http.stream("POST", f"{url.rstrip('/')}/v1/completions", json=body) as a:
                if a.status_code != 200:
                    await a.aread()
                    raise CalibrationError(f"{url}: {a.status_code} {a.text[:300]}")
                async for line in a.aiter_lines():
                    if carries_choices(line):
                        last = time.perf_counter()
                        first = first or last
            if not first:
                raise CalibrationError(f"{url}: request {r.rid} streamed no token")
            n = r.output_tokens
            return first - sent, (last - first) / (n - 1) if n > 1 else float("nan")

        return list(
            await asyncio.gather(*(one(r, p) for r, p in zip(requests, prompts, strict=True)))
        )
