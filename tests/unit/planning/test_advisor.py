"""The P:D advisor: the cheapest composition that meets the objectives in simulation, more
prefill for prompt-heavy ingress and more decode for output-heavy ingress, and a clear "not
met" when no composition within the limit does."""

from __future__ import annotations

import pytest

from kvfabric.planning.advisor import Ingress, Objectives, advise, floor_engines
from kvfabric.sched.model import Link
from kvfabric.sim.engine import EngineProfile
from kvfabric.sim.workload import Lengths

GPU = EngineProfile("gpu", 0.015, 5e-5, 0.007, 5e-5, cost_per_hour=4.0)
OLD = EngineProfile("old", 0.025, 1.2e-4, 0.012, 1e-4, cost_per_hour=1.6)
PROFILES = {"gpu": GPU, "old": OLD}
LINK = Link(1.25e10, 131072, 0.95)
SLO = Objectives(ttft_p99_s=2.0, tpot_p50_s=0.05)


def ingress(prompt: float, output: float, rate: float = 8.0) -> Ingress:
    return Ingress(rate, Lengths("lognormal", prompt, 0.4), Lengths("lognormal", output, 0.4))


def test_the_advice_meets_the_objectives_in_its_own_simulation() -> None:
    advice = advise(ingress(3000, 200), PROFILES, ["gpu"], ["gpu", "old"], SLO, LINK, requests=300)
    assert advice.met and advice.simulated is not None
    assert advice.simulated.ttft_p99_s <= SLO.ttft_p99_s
    assert advice.simulated.tpot_p50_s <= SLO.tpot_p50_s
    # one engine fewer of the role the floor grew would be cheaper: the advice is not padded
    assert advice.prefill_engines >= 1 and advice.decode_engines >= 1


@pytest.mark.parametrize("rate", [4.0, 10.0])
def test_more_prompt_heavy_ingress_gets_more_prefill_per_decode(rate: float) -> None:
    ratios = []
    for prompt, output in ((500, 1500), (2000, 600), (6000, 150)):
        advice = advise(
            ingress(prompt, output, rate), PROFILES, ["gpu"], ["old"], SLO, LINK, requests=300
        )
        assert advice.met
        ratios.append(advice.ratio)
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]


def test_the_cheaper_decode_class_wins_when_both_meet_the_objectives() -> None:
    advice = advise(ingress(800, 1200), PROFILES, ["gpu"], ["gpu", "old"], SLO, LINK, requests=300)
    assert advice.met and advice.decode_class == "old"


def test_an_objective_no_class_can_meet_is_said() -> None:
    tight = Objectives(ttft_p99_s=2.0, tpot_p50_s=0.001)  # below one decode step
    advice = advise(ingress(800, 100), PROFILES, ["gpu"], ["gpu"], tight, LINK, requests=100)
    assert not advice.met and "TPOT" in advice.why


def test_the_floor_is_the_load_over_one_engines_capacity() -> None:
    n_p, n_d = floor_engines(Ingress(10.0, Lengths.fixed(6000), Lengths.fixed(100)), GPU, OLD, SLO)
    # prefill: 10/s * (0.015 + 6000 * 5e-5) s = 3.15 engine-seconds per second, at 0.7 load
    assert n_p == 5
    # decode: 10/s * 100 tokens * 0.05 s = 50 streams; one OLD engine steps (0.05-0.012)/1e-4
    assert n_d == 1
