"""The P:D ratio advisor: how many prefill and decode engines of which class an ingress mix
needs to meet its TTFT and TPOT objectives at the lowest price per hour.

Input: the ingress (an arrival rate and the prompt / output length distributions, observed
or given), the hardware classes' profiles (:class:`~kvfabric.sim.engine.EngineProfile`, with
prices), which classes may prefill and which may decode, and the objectives (p99 TTFT, p50
TPOT). For each pair of a prefill class and a decode class the advisor starts from the
analytic floor (prefill: the prompt tokens per second over what one engine prefills, at
``MAX_PREFILL_LOAD``; decode: the streams in flight, by Little's law, over the batch one engine
decodes within the TPOT objective) and then simulates the candidate
(:func:`kvfabric.sim.cluster.simulate`, kvfabric's own scheduling) on requests drawn from the
ingress, adding a prefill engine while TTFT misses on the prefill side (queue, prefill) and a
decode engine while TPOT misses or TTFT misses on the decode side (hand-off, the decode
engine's first step), up to ``max_engines`` each. The cheapest candidate that meets both is
the advice; none: the advice says which objective no candidate met.

Deterministic under its seed. CPU-bound (a few simulations of ``requests`` requests each):
a gateway runs it off its event loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvfabric.sched.model import Link, Role
from kvfabric.sim.cluster import ClusterSpec, EngineSpec, simulate
from kvfabric.sim.engine import EngineProfile
from kvfabric.sim.results import Summary
from kvfabric.sim.workload import Lengths, Phase, Workload, generate

MAX_PREFILL_LOAD = 0.7  # the analytic floor's utilisation: queueing stays short below it


@dataclass(frozen=True)
class Ingress:
    rate_rps: float
    prompt: Lengths
    output: Lengths


@dataclass(frozen=True)
class Objectives:
    ttft_p99_s: float
    tpot_p50_s: float


@dataclass(frozen=True)
class Advice:
    prefill_class: str
    prefill_engines: int
    decode_class: str
    decode_engines: int
    cost_per_hour: float
    met: bool
    simulated: Summary | None
    why: str = ""

    @property
    def ratio(self) -> float:
        """Prefill engines per decode engine."""
        return self.prefill_engines / self.decode_engines


def advise(
    ingress: Ingress,
    profiles: Mapping[str, EngineProfile],
    prefill_classes: Sequence[str],
    decode_classes: Sequence[str],
    objectives: Objectives,
    link: Link,
    *,
    layers: int = 32,
    max_engines: int = 32,
    requests: int = 600,
    seed: int = 0,
) -> Advice:
    """The cheapest P:D composition meeting ``objectives`` (module docstring)."""
    duration = requests / ingress.rate_rps
    phase = Phase(ingress.rate_rps, duration, ingress.prompt, ingress.output)
    drawn = generate(Workload((phase,)), seed)
    best: Advice | None = None
    closest: Advice | None = None
    for pc in prefill_classes:
        for dc in decode_classes:
            found = _search(ingress, profiles, pc, dc, objectives, link, layers, max_engines, drawn)
            if found.met and (best is None or found.cost_per_hour < best.cost_per_hour):
                best = found
            if not found.met and closest is None:
                closest = found
    if best is not None:
        return best
    assert closest is not None
    return closest


def floor_engines(
    ingress: Ingress,
    prefill: EngineProfile,
    decode: EngineProfile,
    objectives: Objectives,
) -> tuple[int, int]:
    """The analytic floor: (prefill engines, decode engines) before any queueing."""
    prompt, output = ingress.prompt.expected(), ingress.output.expected()
    per_prompt_s = prefill.step_s(max(1, round(prompt)), 0)
    n_prefill = math.ceil(ingress.rate_rps * per_prompt_s / MAX_PREFILL_LOAD)
    # the largest batch one decode engine steps within the TPOT objective
    room = objectives.tpot_p50_s - decode.decode_base_s
    per_engine = (
        decode.max_seqs
        if decode.decode_s_per_seq == 0
        else min(decode.max_seqs, int(room / decode.decode_s_per_seq))
    )
    streams = ingress.rate_rps * output * objectives.tpot_p50_s  # Little's law
    n_decode = math.ceil(streams / per_engine) if per_engine >= 1 else 0
    return max(1, n_prefill), max(1, n_decode)


def _search(
    ingress: Ingress,
    profiles: Mapping[str, EngineProfile],
    pc: str,
    dc: str,
    objectives: Objectives,
    link: Link,
    layers: int,
    max_engines: int,
    drawn: list,  # type: ignore[type-arg]
) -> Advice:
    n_p, n_d = floor_engines(ingress, profiles[pc], profiles[dc], objectives)
    if objectives.tpot_p50_s <= profiles[dc].step_s(0, 1):
        return Advice(pc, n_p, dc, n_d, math.inf, False, None, f"{dc} cannot meet the TPOT")
    while True:
        n_p, n_d = min(n_p, max_engines), min(n_d, max_engines)
        cluster = _cluster(profiles, pc, n_p, dc, n_d, link, layers)
        result = simulate(cluster, drawn)
        summary = result.summary()
        ttft_ok = summary.ttft_p99_s <= objectives.ttft_p99_s
        tpot_ok = math.isnan(summary.tpot_p50_s) or summary.tpot_p50_s <= objectives.tpot_p50_s
        cost = cluster.cost_per_hour()
        if ttft_ok and tpot_ok:
            return Advice(pc, n_p, dc, n_d, cost, True, summary)
        # a late first token is the prefill side's or the decode side's: grow the one that
        # added more to the late requests; a slow TPOT is the decode engines'
        blame = result.ttft_blame(objectives.ttft_p99_s, lambda e: e[0]) if not ttft_ok else {}
        decode_late = blame.get("d", 0.0) > blame.get("p", 0.0)
        grow_p = not ttft_ok and not decode_late and n_p < max_engines
        grow_d = (not tpot_ok or (not ttft_ok and decode_late)) and n_d < max_engines
        if not grow_p and not grow_d:
            missed = ", ".join(
                name for name, ok in (("TTFT p99", ttft_ok), ("TPOT p50", tpot_ok)) if not ok
            )
            why = f"{missed} missed with {max_engines} engines of a role"
            return Advice(pc, n_p, dc, n_d, cost, False, summary, why)
        n_p += grow_p
        n_d += grow_d


def _cluster(
    profiles: Mapping[str, EngineProfile],
    pc: str,
    n_p: int,
    dc: str,
    n_d: int,
    link: Link,
    layers: int,
) -> ClusterSpec:
    engines = tuple(EngineSpec(f"p{i}", pc, Role.PREFILL) for i in range(n_p)) + tuple(
        EngineSpec(f"d{i}", dc, Role.DECODE) for i in range(n_d)
    )
    return ClusterSpec(engines, profiles, link, layers=layers)
