"""One engine's continuous batching: decodes ride along every step, prefills fill the step's
token budget in arrival order, a shared host slows engines that step together."""

from __future__ import annotations

import pytest
import simpy

from kvfabric.sim.engine import EngineProfile, Host, Seq, SimEngine

P = EngineProfile("p", 0.01, 1e-3, 0.005, 1e-3, max_batch_tokens=100)


def run(engine_seqs: list[tuple[float, Seq]], profile: EngineProfile = P, host: Host | None = None):
    env = simpy.Environment()
    engine = SimEngine(env, "e", profile, host)

    def feed():
        for at, seq in engine_seqs:
            if at > env.now:  # arrivals at one instant reach the engine before its next step
                yield env.timeout(at - env.now)
            engine.submit(seq)

    env.process(feed())
    env.run()
    return engine


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget() -> None:
    seq = Seq(250, 1)
    run([(0.0, seq)])
    # 100 + 100 + 50 tokens: three steps
    assert seq.first_s == pytest.approx(3 * 0.01 + 250 * 1e-3)


def test_decoding_sequences_take_one_token_per_step_and_share_it_with_a_prefill() -> None:
    a, b = Seq(10, 4), Seq(20, 1)
    run([(0.0, a), (0.0, b)])
    first_step = P.step_s(30, 0)  # both prefills fit one step: both emit a first token
    assert a.first_s == b.first_s == pytest.approx(first_step)
    # then a decodes alone: three one-sequence steps
    engine = run([(0.0, c := Seq(10, 4)), (0.0, Seq(20, 1))])
    assert c.output_left == 0 and engine.steps == 1 + 3
    assert engine.busy_s == pytest.approx(first_step + 3 * P.step_s(0, 1))


def test_max_seqs_makes_the_rest_wait() -> None:
    one_at_a_time = EngineProfile("s", 0.0, 1e-3, 0.0, 0.0, max_seqs=1)
    a, b = Seq(100, 1), Seq(100, 1)
    run([(0.0, a), (0.0, b)], one_at_a_time)
    assert b.first_s == pytest.approx(2 * a.first_s)


def test_engines_over_a_hosts_cores_slow_down() -> None:
    slow_alone = EngineProfile("x", 0.0, 1e-3, 0.0, 0.0, threads=2)
    host = Host(cores=2)
    env = simpy.Environment()
    e1, e2 = SimEngine(env, "a", slow_alone, host), SimEngine(env, "b", slow_alone, host)
    s1, s2 = Seq(1000, 1), Seq(1000, 1)
    e1.submit(s1)
    e2.submit(s2)
    env.run()
    # the second engine starts its step while the first holds both cores: twice as slow
    assert s1.first_s == pytest.approx(1.0) and s2.first_s == pytest.approx(2.0)
