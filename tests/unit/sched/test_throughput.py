"""A fresh engine is planned by its class's prior, a measured one by what it did."""

from __future__ import annotations

import pytest

from kvfabric.sched.throughput import DECODE, PREFILL, ClassPrior, Throughput

PRIORS = {"decode-cpu": ClassPrior(prefill_tps=500.0, decode_tps=20.0)}


def test_before_any_sample_the_class_prior_answers() -> None:
    rates = Throughput(PRIORS)
    assert rates.rate("cpu-1", "decode-cpu", PREFILL) == 500.0
    assert rates.rate("cpu-1", "decode-cpu", DECODE) == 20.0
    with pytest.raises(KeyError):
        rates.rate("gpu-1", "unknown-class", PREFILL)


def test_samples_are_averaged_with_more_weight_on_the_recent() -> None:
    rates = Throughput(PRIORS, alpha=0.5)
    rates.observe("cpu-1", DECODE, tokens=100, seconds=10.0)  # 10 tokens/s
    assert rates.rate("cpu-1", "decode-cpu", DECODE) == 10.0
    rates.observe("cpu-1", DECODE, tokens=300, seconds=10.0)  # 30 tokens/s
    assert rates.rate("cpu-1", "decode-cpu", DECODE) == 20.0
    assert rates.rate("cpu-1", "decode-cpu", PREFILL) == 500.0  # the other phase: prior
    assert rates.rate("cpu-2", "decode-cpu", DECODE) == 20.0  # another engine: prior


def test_samples_without_tokens_or_time_carry_no_rate() -> None:
    rates = Throughput(PRIORS)
    rates.observe("cpu-1", PREFILL, tokens=0, seconds=1.0)
    rates.observe("cpu-1", PREFILL, tokens=10, seconds=0.0)
    assert rates.rate("cpu-1", "decode-cpu", PREFILL) == 500.0
    with pytest.raises(ValueError):
        rates.observe("cpu-1", "verify", tokens=1, seconds=1.0)
    with pytest.raises(ValueError):
        Throughput(PRIORS, alpha=0.0)


def test_the_handoff_cost_is_the_prior_until_measured_then_its_average() -> None:
    rates = Throughput(PRIORS, alpha=0.5)
    assert rates.handoff_s(prior=0.005) == 0.005
    rates.observe_handoff(0.060)
    assert rates.handoff_s(prior=0.005) == 0.060
    rates.observe_handoff(0.020)
    assert rates.handoff_s(prior=0.005) == pytest.approx(0.040)
    rates.observe_handoff(-0.010)  # a transfer faster than modelled: no negative cost
    assert rates.handoff_s(prior=0.005) == pytest.approx(0.020)
