"""The simulator against a real cluster: calibrate, drive, simulate, compare.

Given running vLLM engines (all of one class, each role ``both``) behind a kvfabric gateway
(:mod:`kvfabric.gateway`, with ``max_running`` slots per engine), :func:`validate`

1. calibrates the class on the first engine while the others idle
   (:func:`kvfabric.planning.calibrate.calibrate`);
2. draws a request mix (Poisson arrivals at ``load`` of what the calibrated engines can
   serve, uniform prompt and output lengths) and sends it through the gateway at those
   times, streamed, greedy, ``ignore_eos`` (every output has exactly its drawn length),
   timing each request's first token and its last at the client;
3. simulates the same requests (same arrival times and lengths) on the same cluster
   (:func:`kvfabric.sim.cluster.simulate`: the engines on one host of ``host_cores``);
4. reports measured and simulated TTFT p50 / p99 and TPOT p50, and each one's relative error
   ``|simulated - measured| / measured``.

Blocking; the caller owns the processes. A request that fails raises
:class:`~kvfabric.planning.calibrate.CalibrationError`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from kvfabric.planning.calibrate import CalibrationError, calibrate, carries_choices
from kvfabric.sched.model import Link, Role
from kvfabric.sim.cluster import ClusterSpec, EngineSpec, simulate
from kvfabric.sim.engine import EngineProfile
from kvfabric.sim.workload import Lengths, Phase, SimRequest, Workload, generate

CLASS = "measured"
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
    requests: int
    measured: Figures
    simulated: Figures

    def error(self, name: str) -> float:
        m: float = getattr(self.measured, name)
        s: float = getattr(self.simulated, name)
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
) -> Validation:
    profile = calibrate(engine_urls[0], model, CLASS, vocab=vocab, timeout_s=timeout_s).profile
    per_request = profile.step_s(round(prompt.expected()), 0) + output.expected() * profile.step_s(
        0, 1
    )
    rate = load * len(engine_urls) / per_request
    phase = Phase(rate, count / rate, prompt, output)
    requests = generate(Workload((phase,)), seed)
    measured = asyncio.run(_drive(gateway_url, model, requests, vocab, seed, timeout_s))
    cluster = ClusterSpec(
        tuple(
            EngineSpec(f"e{i}", CLASS, Role.BOTH, host="host", max_running=max_running)
            for i in range(len(engine_urls))
        ),
        {CLASS: profile},
        Link(1e9, 0),
        hosts={"host": host_cores},
    )
    sim = simulate(cluster, requests).summary()
    return Validation(
        profile,
        rate,
        len(requests),
        _figures(measured),
        Figures(sim.ttft_p50_s, sim.ttft_p99_s, sim.tpot_p50_s),
    )


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
