"""The gateway's P:D advice follows the ingress it sees: a window of finished requests,
advised by the capacity planner over the configured classes, exported as gauges."""

from __future__ import annotations

import asyncio

from kvfabric.gateway.advice import AdviceLoop, IngressWindow
from kvfabric.gateway.config import AdvisorConfig, ClassConfig, EngineConfig
from kvfabric.gateway.metrics import GatewayMetrics
from kvfabric.sched.model import Link
from kvfabric.sched.throughput import ClassPrior, Throughput

CLASSES = {
    "gpu": ClassConfig(prefill_tps=20_000, decode_tps=100, cost_per_hour=4.0),
    "old": ClassConfig(prefill_tps=8_000, decode_tps=80, cost_per_hour=1.6),
}
ENGINES = (
    EngineConfig("p", "http://127.0.0.1:9", "gpu", role="prefill"),
    EngineConfig("d", "http://127.0.0.1:9", "old", role="decode"),
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_window_keeps_the_last_window_s_of_requests() -> None:
    clock = Clock()
    window = IngressWindow(10.0, clock)
    for t in range(20):
        clock.now = float(t)
        window.add(100 * t, 10)
    seen, prompts, _ = window.snapshot()
    assert prompts == tuple(100 * t for t in range(9, 20))  # t >= 19 - 10
    assert seen.requests == 11 and seen.rate_rps == 1.1


def loop(metrics: GatewayMetrics) -> AdviceLoop:
    throughput = Throughput(
        {n: ClassPrior(c.prefill_tps, c.decode_tps) for n, c in CLASSES.items()}
    )
    config = AdvisorConfig(ttft_p99_s=2.0, tpot_p50_s=0.05, window_s=60.0, min_requests=20)
    return AdviceLoop(config, CLASSES, ENGINES, throughput, Link(1.25e10, 131072), metrics)


def test_the_advice_follows_the_mix_and_is_exported() -> None:
    metrics = GatewayMetrics()
    advice = loop(metrics)
    assert advice.json()["advice"] is None  # nothing seen yet
    for _ in range(300):
        advice.window.add(8000, 50)  # long prompts, short answers: 5 per second
    asyncio.run(advice.advise_now())
    prompt_heavy = advice.json()["advice"]
    assert prompt_heavy["met"] and prompt_heavy["prefill"]["hardware_class"] == "gpu"
    value = metrics.registry.get_sample_value
    engines = prompt_heavy["prefill"]["engines"]
    assert (
        value("kvfabric_gateway_advised_engines", {"role": "prefill", "hardware_class": "gpu"})
        == engines
    )

    output_heavy = loop(GatewayMetrics())
    for _ in range(300):
        output_heavy.window.add(300, 2000)
    asyncio.run(output_heavy.advise_now())
    after = output_heavy.json()["advice"]
    assert after["ratio"] < prompt_heavy["ratio"]


def test_a_class_profile_comes_from_what_its_engines_measured() -> None:
    advice = loop(GatewayMetrics())
    before = advice.profiles()["old"]
    advice._throughput.observe("d", "decode", 100, 2.0)  # 50 tokens/s measured
    after = advice.profiles()["old"]
    assert before.decode_base_s == 1 / 80 and after.decode_base_s == 1 / 50
    assert after.decode_s_per_seq == after.decode_base_s * CLASSES["old"].decode_batch_cost
