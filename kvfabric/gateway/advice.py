"""The P:D advice for the ingress the gateway sees (``GET /v1/advice``, metrics).

Every finished request adds its prompt and output tokens to a window of the last
``advisor.window_s`` seconds. Every ``advisor.interval_s`` the gateway hands that window (its
arrival rate and its length distributions, drawn as observed) to the capacity planner's
advisor (:func:`kvfabric.planning.advisor.advise`) with its classes' profiles: a class's
prefill and decode rates as its engines measured them (the configured prior until then),
its price, and ``decode_batch_cost`` (what each further stream in a decode batch adds to a
step, as a share of one stream's step: decode is memory-bound). The advice (prefill and
decode engines of which class, the price per hour, whether the objectives can be met) is
kept until the next round and exported as gauges, so it follows the mix as it shifts.

The simulation runs in a worker thread (a few hundred requests: under a second here); the
loop runs on the gateway's event loop. With fewer than ``advisor.min_requests`` requests in
the window there is no advice (``/v1/advice`` says so).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfabric.gateway.config import AdvisorConfig, ClassConfig, EngineConfig
from kvfabric.gateway.metrics import GatewayMetrics
from kvfabric.planning.advisor import Advice, Ingress, Objectives, advise
from kvfabric.sched.model import Link, Role
from kvfabric.sched.throughput import Throughput
from kvfabric.sim.engine import EngineProfile
from kvfabric.sim.workload import Lengths

log = logging.getLogger("kvfabric.gateway")
ADVICE_REQUESTS = 300  # simulated per candidate: the advice in well under a second


@dataclass(frozen=True)
class Observed:
    requests: int
    rate_rps: float
    prompt_mean: float
    output_mean: float


class IngressWindow:
    """(time, prompt tokens, output tokens) of the requests finished in the last window."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._seen: collections.deque[tuple[float, int, int]] = collections.deque()

    def add(self, prompt_tokens: int, output_tokens: int) -> None:
        self._seen.append((self._clock(), prompt_tokens, output_tokens))
        self._trim()

    def snapshot(self) -> tuple[Observed, tuple[int, ...], tuple[int, ...]]:
        self._trim()
        prompts = tuple(p for _, p, _ in self._seen)
        outputs = tuple(max(1, o) for _, _, o in self._seen)
        n = len(prompts)
        observed = Observed(
            n,
            n / self._window_s,
            sum(prompts) / n if n else 0.0,
            sum(outputs) / n if n else 0.0,
        )
        return observed, prompts, outputs

    def _trim(self) -> None:
        oldest = self._clock() - self._window_s
        while self._seen and self._seen[0][0] < oldest:
            self._seen.popleft()


class AdviceLoop:
    def __init__(
        self,
        config: AdvisorConfig,
        classes: Mapping[str, ClassConfig],
        engines: tuple[EngineConfig, ...],
        throughput: Throughput,
        link: Link,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.window = IngressWindow(config.window_s)
        self._classes = classes
        self._engines = engines
        self._throughput = throughput
        self._link = link
        self._metrics = metrics
        self.latest: Advice | None = None
        self.observed: Observed | None = None

    async def run(self) -> None:
        """Advise every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.advise_now()

    async def advise_now(self) -> None:
        observed, prompts, outputs = self.window.snapshot()
        self.observed = observed
        self._metrics.ingress_rate.set(observed.rate_rps)
        if observed.requests < self.config.min_requests:
            return
        ingress = Ingress(
            observed.rate_rps,
            Lengths("empirical", values=prompts),
            Lengths("empirical", values=outputs),
        )
        profiles = self.profiles()
        objectives = Objectives(self.config.ttft_p99_s, self.config.tpot_p50_s)
        self.latest = await asyncio.to_thread(
            advise,
            ingress,
            profiles,
            self._classes_for(Role.PREFILL),
            self._classes_for(Role.DECODE),
            objectives,
            self._link,
            requests=ADVICE_REQUESTS,
        )
        self._export(self.latest)

    def _classes_for(self, role: Role) -> list[str]:
        """The declared classes of the engines that can take ``role`` (an engine whose
        class comes from the node registry is left out: the advice is about classes)."""
        found = {e.hardware_class for e in self._engines if _can(e, role) and e.hardware_class}
        return sorted(c for c in found if c is not None)

    def profiles(self) -> dict[str, EngineProfile]:
        """Each class's profile from its engines' measured rates (mean), else its prior."""
        out = {}
        for name, c in self._classes.items():
            mine = [e.id for e in self._engines if e.hardware_class == name]
            prefill = _mean([self._throughput.rate(e, name, "prefill") for e in mine]) or (
                c.prefill_tps
            )
            decode = _mean([self._throughput.rate(e, name, "decode") for e in mine]) or (
                c.decode_tps
            )
            step = 1.0 / decode
            out[name] = EngineProfile(
                name,
                prefill_base_s=0.0,
                prefill_s_per_token=1.0 / prefill,
                decode_base_s=step,
                decode_s_per_seq=step * c.decode_batch_cost,
                cost_per_hour=c.cost_per_hour,
            )
        return out

    def json(self) -> dict[str, Any]:
        advice, seen = self.latest, self.observed
        body: dict[str, Any] = {
            "window_s": self.config.window_s,
            "observed": None if seen is None else vars(seen),
            "objectives": {
                "ttft_p99_s": self.config.ttft_p99_s,
                "tpot_p50_s": self.config.tpot_p50_s,
            },
        }
        if advice is None:
            body["advice"] = None
            body["why"] = f"fewer than {self.config.min_requests} requests in the window yet"
            return body
        body["advice"] = {
            "prefill": {"hardware_class": advice.prefill_class, "engines": advice.prefill_engines},
            "decode": {"hardware_class": advice.decode_class, "engines": advice.decode_engines},
            "ratio": advice.ratio,
            "cost_per_hour": advice.cost_per_hour,
            "met": advice.met,
            "why": advice.why,
        }
        return body

    def _export(self, advice: Advice) -> None:
        gauge = self._metrics.advised_engines
        gauge.clear()
        gauge.labels("prefill", advice.prefill_class).set(advice.prefill_engines)
        gauge.labels("decode", advice.decode_class).set(advice.decode_engines)
        self._metrics.advised_cost.set(advice.cost_per_hour)
        log.info(
            "advice: %d %s prefill : %d %s decode%s",
            advice.prefill_engines,
            advice.prefill_class,
            advice.decode_engines,
            advice.decode_class,
            "" if advice.met else f" (objectives not met: {advice.why})",
        )


def _can(engine: EngineConfig, role: Role) -> bool:
    r = engine.role_value
    return r.prefills() if role is Role.PREFILL else r.decodes()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
