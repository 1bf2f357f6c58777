"""The questions a capacity plan answers, as tables (``kvfabric plan report``):

* :func:`mono_vs_disagg` -- the same engines run monolithic (each does both phases) or
  disaggregated (the advisor's split into prefill and decode): TTFT / TPOT p99 and each
  role's utilisation, for a workload (the long-prompt and long-output mixes);
* :func:`overlap_grid` -- layer-wise streaming: the share of a prompt's KV on the decode node
  when prefill ends, by link bandwidth and layer count, for one prompt on the prefill class;
* :func:`tiered_vs_flat` -- a cluster of the newest class for prefill, an older class for
  interactive decode and CPU nodes for the batch share's decode, against one of the newest
  class alone, each sized to the same objectives: price per million tokens;
* :func:`rebalance` -- the advice per window of an ingress whose mix shifts.

Each returns frozen rows; :mod:`kvfabric.planning.figures` draws them. Deterministic under
the seed; CPU-bound (simulations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfabric.planning.advisor import Advice, Ingress, Objectives, advise
from kvfabric.planning.inputs import PlanInputs
from kvfabric.sched.model import Priority, Role
from kvfabric.sim.cluster import ClusterSpec, EngineSpec, simulate
from kvfabric.sim.overlap import layerwise
from kvfabric.sim.results import SimResult
from kvfabric.sim.workload import Lengths, Phase, SimRequest, Tenant, Workload, generate

STUDY_REQUESTS = 600


@dataclass(frozen=True)
class LayoutRow:
    workload: str
    layout: str  # "monolithic" or "disaggregated P:D"
    engines: int
    ttft_p99_s: float
    tpot_p99_s: float
    prefill_utilisation: float  # mean over the engines that prefill (monolithic: all)
    decode_utilisation: float


def mono_vs_disagg(inputs: PlanInputs, workload: str, seed: int = 0) -> list[LayoutRow]:
    """Monolithic against disaggregated on the same engines of the first prefill class."""
    ingress = inputs.workloads[workload].ingress()
    cls = inputs.roles.prefill[0]
    profiles, link = inputs.profiles(), inputs.link_value()
    advice = advise(
        ingress,
        profiles,
        [cls],
        [cls],
        inputs.objectives_value(),
        link,
        layers=inputs.model.layers,
        requests=STUDY_REQUESTS,
        seed=seed,
    )
    n = advice.prefill_engines + advice.decode_engines
    requests = _draw(ingress, seed)
    rows = []
    for layout, engines in (
        ("monolithic", tuple(EngineSpec(f"m{i}", cls, Role.BOTH) for i in range(n))),
        (
            f"disaggregated {advice.prefill_engines}:{advice.decode_engines}",
            tuple(EngineSpec(f"p{i}", cls, Role.PREFILL) for i in range(advice.prefill_engines))
            + tuple(EngineSpec(f"d{i}", cls, Role.DECODE) for i in range(advice.decode_engines)),
        ),
    ):
        cluster = ClusterSpec(engines, profiles, link, layers=inputs.model.layers)
        result = simulate(cluster, requests)
        summary = result.summary()
        util = summary.utilisation
        prefill = [util[e.engine_id] for e in engines if e.role.prefills()]
        decode = [util[e.engine_id] for e in engines if e.role.decodes()]
        rows.append(
            LayoutRow(
                workload,
                layout,
                n,
                summary.ttft_p99_s,
                summary.tpot_p99_s,
                float(np.mean(prefill)),
                float(np.mean(decode)),
            )
        )
    return rows


@dataclass(frozen=True)
class OverlapRow:
    layers: int
    bytes_per_s: float
    landed_fraction: float
    tail_s: float


def overlap_grid(
    inputs: PlanInputs,
    prompt_tokens: int,
    layer_counts: Sequence[int],
    bandwidths: Sequence[float],
) -> list[OverlapRow]:
    """One prompt's prefill on the first prefill class, streamed over each link."""
    profile = inputs.profiles()[inputs.roles.prefill[0]]
    prefill_s = profile.step_s(prompt_tokens, 0)
    kv = prompt_tokens * inputs.model.kv_bytes_per_token
    rows = []
    for layers in layer_counts:
        for bw in bandwidths:
            streamed = layerwise(prefill_s, kv, layers, bw, inputs.link.handoff_fixed_s)
            rows.append(OverlapRow(layers, bw, streamed.landed_fraction, streamed.tail_s))
    return rows


def simulated_landed_fraction(result: SimResult) -> float:
    """The mean share of KV landed at prefill end over a run's pushed hand-offs."""
    pushed = [r.landed_fraction for r in result.requests if r.mode == "push"]
    return float(np.mean(pushed)) if pushed else math.nan


@dataclass(frozen=True)
class PriceRow:
    cluster: str
    composition: str
    cost_per_hour: float
    tokens_per_s: float
    cost_per_million_tokens: float
    ttft_p99_s: float
    interactive_tpot_p50_s: float
    batch_tpot_p50_s: float
    met: bool


def tiered_vs_flat(
    inputs: PlanInputs,
    workload: str,
    classes: tuple[str, str, str],
    batch_share: float,
    batch_tpot_p50_s: float,
    seed: int = 0,
    max_engines: int = 32,
) -> list[PriceRow]:
    """``classes`` = (newest, older, cpu): the newest alone against newest-prefill /
    older-decode / cpu-for-batch, each grown from one engine per pool until the objectives
    hold (interactive requests: TTFT p99 and TPOT p50; batch ones: TTFT p99 and
    ``batch_tpot_p50_s``)."""
    ingress = inputs.workloads[workload].ingress()
    objectives = inputs.objectives_value()
    top, older, cpu = classes
    requests = _draw(ingress, seed, batch_share)
    flat = {"prefill": (top, Role.PREFILL), "decode": (top, Role.DECODE)}
    tiered = {
        "prefill": (top, Role.PREFILL),
        "decode": (older, Role.DECODE),
        "batch-decode": (cpu, Role.DECODE),
    }
    return [
        _grow(inputs, name, pools, requests, objectives, batch_tpot_p50_s, max_engines)
        for name, pools in (("all " + top, flat), ("tiered", tiered))
    ]


def _grow(
    inputs: PlanInputs,
    name: str,
    pools: dict[str, tuple[str, Role]],
    requests: list[SimRequest],
    objectives: Objectives,
    batch_tpot_s: float,
    max_engines: int,
) -> PriceRow:
    counts = dict.fromkeys(pools, 1)
    profiles, link = inputs.profiles(), inputs.link_value()
    while True:
        engines = tuple(
            EngineSpec(f"{pool}{i}", cls, role)
            for pool, (cls, role) in pools.items()
            for i in range(counts[pool])
        )
        cluster = ClusterSpec(engines, profiles, link, layers=inputs.model.layers)
        result = simulate(cluster, requests)
        overall = result.summary()
        inter = result.summary(lambda r: r.priority == Priority.INTERACTIVE.value)
        batch = result.summary(lambda r: r.priority == Priority.BATCH.value)
        pool_of = {e.engine_id: e.engine_id.rstrip("0123456789") for e in engines}
        late = overall.ttft_p99_s > objectives.ttft_p99_s
        blame = result.ttft_blame(objectives.ttft_p99_s, pool_of.__getitem__) if late else {}
        worst = max(blame, key=blame.__getitem__) if blame else None
        misses = {
            "prefill": worst == "prefill",
            "decode": worst == "decode"
            or _above(inter.tpot_p50_s, objectives.tpot_p50_s)
            or ("batch-decode" not in pools and _above(batch.tpot_p50_s, batch_tpot_s)),
            "batch-decode": worst == "batch-decode" or _above(batch.tpot_p50_s, batch_tpot_s),
        }
        grow = [p for p in pools if misses[p] and counts[p] < max_engines]
        met = not late and not any(misses[p] for p in pools)
        if met or not grow:
            composition = ", ".join(f"{counts[p]} {cls} {p}" for p, (cls, _) in pools.items())
            return PriceRow(
                name,
                composition,
                overall.cost_per_hour,
                overall.tokens_per_s,
                overall.cost_per_million_tokens,
                overall.ttft_p99_s,
                inter.tpot_p50_s,
                batch.tpot_p50_s,
                met,
            )
        for p in grow:
            counts[p] += 1


def _above(value: float, bound: float) -> bool:
    return not math.isnan(value) and value > bound


@dataclass(frozen=True)
class WindowAdvice:
    start_s: float
    rate_rps: float
    prompt_mean: float
    output_mean: float
    advice: Advice


def rebalance(
    inputs: PlanInputs,
    requests: Sequence[SimRequest],
    window_s: float,
    seed: int = 0,
) -> list[WindowAdvice]:
    """The advice for each ``window_s`` of an observed ingress (its rate and its lengths, as
    a gateway sees them), over the classes ``roles`` allows."""
    out = []
    end = max(r.arrival_s for r in requests)
    start = 0.0
    while start < end:
        seen = [r for r in requests if start <= r.arrival_s < start + window_s]
        if seen:
            ingress = Ingress(
                len(seen) / window_s,
                Lengths("empirical", values=tuple(r.prompt_tokens for r in seen)),
                Lengths("empirical", values=tuple(r.output_tokens for r in seen)),
            )
            advice = inputs.advise(ingress, requests=STUDY_REQUESTS // 2, seed=seed)
            out.append(
                WindowAdvice(
                    start,
                    ingress.rate_rps,
                    ingress.prompt.expected(),
                    ingress.output.expected(),
                    advice,
                )
            )
        start += window_s
    return out


def shifting_ingress(
    inputs: PlanInputs, first: str, then: str, each_s: float, seed: int
) -> list[SimRequest]:
    """Requests of workload ``first`` for ``each_s``, then of ``then`` (a mix that shifts)."""
    phases = []
    for name in (first, then):
        w = inputs.workloads[name].ingress()
        phases.append(Phase(w.rate_rps, each_s, w.prompt, w.output))
    return generate(Workload(tuple(phases)), seed)


def _draw(ingress: Ingress, seed: int, batch_share: float = 0.0) -> list[SimRequest]:
    tenants: tuple[Tenant, ...] = (Tenant("interactive", 1.0 - batch_share),)
    if batch_share > 0:
        tenants += (Tenant("batch", batch_share, Priority.BATCH),)
    if batch_share >= 1.0:
        tenants = (Tenant("batch", 1.0, Priority.BATCH),)
    duration = STUDY_REQUESTS / ingress.rate_rps
    phase = Phase(ingress.rate_rps, duration, ingress.prompt, ingress.output, tenants)
    return generate(Workload((phase,)), seed)
