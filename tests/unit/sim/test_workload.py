"""Workloads are drawn up front from a seed: rates, lengths and mixes as asked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvfabric.sched.model import Priority
from kvfabric.sim.workload import Lengths, Phase, Tenant, Workload, generate, lengths_from_file


def test_poisson_arrivals_have_the_phase_rate_and_span() -> None:
    requests = generate(Workload((Phase(50.0, 200.0, Lengths.fixed(10), Lengths.fixed(5)),)), 1)
    assert len(requests) == pytest.approx(50 * 200, rel=0.03)
    times = np.array([r.arrival_s for r in requests])
    assert np.all(np.diff(times) >= 0) and times[-1] < 200.0
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential gaps


def test_bursty_arrivals_keep_the_mean_rate_but_bunch_up() -> None:
    phase = Phase(20.0, 500.0, Lengths.fixed(10), Lengths.fixed(5), bursty=True)
    times = np.array([r.arrival_s for r in generate(Workload((phase,)), 2)])
    assert len(times) == pytest.approx(20 * 500, rel=0.15)
    per_second = np.bincount(times.astype(int))
    assert per_second.var() / per_second.mean() > 3  # Poisson would give about 1


def test_lengths_follow_their_distributions() -> None:
    rng = np.random.default_rng(0)
    assert Lengths("lognormal", 2000, 0.5).sample(rng, 50_000).mean() == pytest.approx(
        2000, rel=0.02
    )
    assert Lengths("exponential", 300).sample(rng, 50_000).mean() == pytest.approx(300, rel=0.02)
    uniform = Lengths("uniform", low=8, high=48).sample(rng, 10_000)
    assert uniform.min() == 8 and uniform.max() == 48
    with pytest.raises(ValueError):
        Lengths("zipf")


def test_a_shifting_mix_is_two_phases_and_tenants_share_the_arrivals() -> None:
    first = Phase(10.0, 100.0, Lengths.fixed(5000), Lengths.fixed(100))
    second = Phase(
        10.0,
        100.0,
        Lengths.fixed(500),
        Lengths.fixed(1000),
        tenants=(Tenant("a", 3.0), Tenant("b", 1.0, Priority.BATCH)),
    )
    requests = generate(Workload((first, second)), 3)
    late = [r for r in requests if r.arrival_s >= 100.0]
    assert all(r.prompt_tokens == 5000 for r in requests if r.arrival_s < 100.0)
    assert all(r.prompt_tokens == 500 and r.phase == 1 for r in late)
    share_a = sum(r.tenant == "a" for r in late) / len(late)
    assert share_a == pytest.approx(0.75, abs=0.06)
    assert all(r.priority is Priority.BATCH for r in late if r.tenant == "b")


def test_an_ingress_log_gives_an_empirical_distribution(tmp_path: Path) -> None:
    log = tmp_path / "ingress.jsonl"
    log.write_text("\n".join(json.dumps({"prompt_tokens": n}) for n in (10, 20, 30)) + "\n")
    lengths = lengths_from_file(log, "prompt_tokens")
    drawn = lengths.sample(np.random.default_rng(0), 1000)
    assert set(drawn) == {10, 20, 30} and lengths.expected() == 20
    log.write_text('{"output_tokens": 3}\n')
    with pytest.raises(ValueError, match="1"):
        lengths_from_file(log, "prompt_tokens")
