"""The simulated cluster against closed forms: one request's TTFT is the sum of its modelled
parts; an engine serving one request at a time under Poisson arrivals and exponential work is
an M/M/1 queue; a seed decides everything."""

from __future__ import annotations

import dataclasses

import pytest

from kvfabric.sched.model import Link, Role
from kvfabric.sim.cluster import ClusterSpec, EngineSpec, simulate
from kvfabric.sim.engine import EngineProfile
from kvfabric.sim.fabric import FabricSpec
from kvfabric.sim.overlap import layerwise
from kvfabric.sim.workload import Lengths, Phase, SimRequest, Workload, generate

FAST = EngineProfile("fast", 0.010, 1e-4, 0.008, 1e-4, cost_per_hour=4.0)
SLOW = EngineProfile("slow", 0.030, 5e-4, 0.020, 5e-4, cost_per_hour=1.0)
LINK = Link(bytes_per_s=1e9, kv_bytes_per_token=100_000, overlap=0.95)


def one(prompt: int, output: int, at: float = 0.0, group: int = -1, shared: int = 0, rid: int = 0):
    return SimRequest(rid, at, "t", _interactive(), prompt, output, group, shared)


def _interactive():
    from kvfabric.sched.model import Priority

    return Priority.INTERACTIVE


def test_a_lone_request_on_one_engine_takes_its_prefill_step_then_a_step_per_token() -> None:
    cluster = ClusterSpec((EngineSpec("e", "fast"),), {"fast": FAST}, LINK)
    (r,) = simulate(cluster, [one(1000, 5)]).requests
    assert r.ttft_s == pytest.approx(FAST.step_s(1000, 0), rel=1e-12)
    assert r.tpot_s == pytest.approx(FAST.step_s(0, 1), rel=1e-12)
    assert r.mode == "single"


def test_a_disaggregated_requests_ttft_is_prefill_plus_handoff_plus_the_first_decode_step() -> None:
    cluster = ClusterSpec(
        (EngineSpec("p", "fast", Role.PREFILL), EngineSpec("d", "slow", Role.DECODE)),
        {"fast": FAST, "slow": SLOW},
        LINK,
        layers=8,
    )
    (r,) = simulate(cluster, [one(4000, 3)]).requests
    prefill = FAST.step_s(4000, 0)
    tail = layerwise(prefill, 4000 * LINK.kv_bytes_per_token, 8, LINK.bytes_per_s, 0.005).tail_s
    assert (r.mode, r.prefill_engine, r.decode_engine) == ("push", "p", "d")
    assert r.ttft_s == pytest.approx(prefill + tail + SLOW.step_s(1, 0), rel=1e-12)
    assert r.tpot_s == pytest.approx(SLOW.step_s(0, 1), rel=1e-12)


def test_a_pulled_handoff_waits_for_the_whole_prompts_kv_after_prefill() -> None:
    cluster = ClusterSpec(
        (
            EngineSpec("p", "fast", Role.PREFILL, pushes=False),
            EngineSpec("d", "slow", Role.DECODE),
        ),
        {"fast": FAST, "slow": SLOW},
        LINK,
    )
    (r,) = simulate(cluster, [one(4000, 3)]).requests
    handoff = 4000 * LINK.kv_bytes_per_token / LINK.bytes_per_s + 0.005
    assert r.mode == "pull"
    assert r.ttft_s == pytest.approx(FAST.step_s(4000, 0) + handoff + SLOW.step_s(1, 0))


def test_a_prefix_the_node_holds_is_not_computed_again() -> None:
    cluster = ClusterSpec(
        (EngineSpec("e", "fast"),), {"fast": FAST}, LINK, fabric=FabricSpec(dram_tokens=10_000)
    )
    first, second = simulate(
        cluster, [one(3000, 1, 0.0, group=7, shared=2048), one(3000, 1, 10.0, 7, 2048, rid=1)]
    ).requests
    assert first.reused_tokens == 0 and second.reused_tokens == 2048
    assert second.ttft_s == pytest.approx(FAST.step_s(3000 - 2048, 0), rel=1e-12)


def test_one_at_a_time_under_poisson_arrivals_is_an_m_m_1_queue() -> None:
    # exponential work (prompt tokens at a fixed cost each), one sequence at a time, FIFO
    per_token = 1e-3
    server = EngineProfile("m", 0.0, per_token, 0.0, 0.0, max_seqs=1, max_batch_tokens=1 << 30)
    mean_tokens = 1000  # service mean 1 s: mu = 1
    lam = 0.6
    phase = Phase(lam, 150_000 / lam, Lengths("exponential", mean_tokens), Lengths.fixed(1))
    requests = generate(Workload((phase,)), seed=5)
    result = simulate(ClusterSpec((EngineSpec("e", "m"),), {"m": server}, LINK), requests)
    mu = 1 / (mean_tokens * per_token)
    waits = [r.ttft_s - r.prompt_tokens * per_token for r in result.requests]
    expected_wait = lam / (mu * (mu - lam))  # M/M/1: Wq = rho / (mu - lam)
    assert sum(waits) / len(waits) == pytest.approx(expected_wait, rel=0.05)
    busy = result.busy_s["e"] / result.horizon_s
    assert busy == pytest.approx(lam / mu, rel=0.02)


def test_a_seed_decides_every_figure() -> None:
    phase = Phase(
        20.0,
        20.0,
        Lengths("lognormal", 800, 0.6),
        Lengths("uniform", low=1, high=64),
        prefix_groups=5,
        shared_prefix_tokens=256,
    )
    cluster = ClusterSpec(
        (
            EngineSpec("p", "fast", Role.PREFILL),
            EngineSpec("d0", "slow", Role.DECODE),
            EngineSpec("d1", "slow", Role.DECODE),
            EngineSpec("b", "fast", Role.BOTH),
        ),
        {"fast": FAST, "slow": SLOW},
        LINK,
        fabric=FabricSpec(dram_tokens=1024, ssd_tokens=4096),
    )
    runs = [simulate(cluster, generate(Workload((phase,)), seed=s)) for s in (3, 3, 4)]
    assert runs[0].requests == runs[1].requests and runs[0].events == runs[1].events
    assert runs[0].requests != runs[2].requests
    assert {r.mode for r in runs[0].requests} >= {"single", "push"}


def test_an_engine_spec_must_name_a_known_class_and_host() -> None:
    with pytest.raises(ValueError, match="profile"):
        ClusterSpec((EngineSpec("e", "tpu"),), {"fast": FAST}, LINK)
    with pytest.raises(ValueError, match="host"):
        ClusterSpec((dataclasses.replace(EngineSpec("e", "fast"), host="h"),), {"fast": FAST}, LINK)
