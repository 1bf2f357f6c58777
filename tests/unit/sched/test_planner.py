"""Plans for one request, computed by hand: where each phase goes and why."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.sched.model import (
    EngineState,
    HardwareProfile,
    Holdings,
    Link,
    Priority,
    Request,
    Role,
)
from kvfabric.sched.planner import PULL, PUSH, SINGLE, NoEngineError, Policy, plan

# 1 GB/s between nodes, 100 KB of KV per token, 90% of a streamed prefill lands during it
LINK = Link(bytes_per_s=1e9, kv_bytes_per_token=100_000, overlap=0.9)
POLICY = Policy(
    {
        "prefill-gpu": HardwareProfile("prefill-gpu", 36.0),  # 0.01 per second
        "decode-gpu": HardwareProfile("decode-gpu", 18.0),  # 0.005 per second
        "decode-cpu": HardwareProfile("decode-cpu", 3.6),  # 0.001 per second
    },
    LINK,
    handoff_fixed_s=0.005,
)


def engine(engine_id: str, node: str, cls: str, role: Role, prefill: float, decode: float, **kw):
    return EngineState(engine_id, node, cls, role, prefill, decode, **kw)


P = engine("p", "n1", "prefill-gpu", Role.PREFILL, 10_000, 1)
D = engine("d", "n2", "decode-gpu", Role.DECODE, 1, 100)
CPU = engine("cpu", "n3", "decode-cpu", Role.DECODE, 1, 30)
MONO = engine("mono", "n4", "decode-gpu", Role.BOTH, 2_000, 100)


def test_a_long_prompt_is_prefilled_on_the_fast_class_and_streamed_to_decode() -> None:
    request = Request("t", prompt_tokens=10_000, max_output_tokens=100)
    chosen = plan(request, Holdings(), [P, D, MONO], POLICY)
    # p+d: prefill 1 s; hand-off: 10% of 10,000 tokens * 100 KB at 1 GB/s = 0.1 s + 5 ms
    # mono: prefill 5 s
    assert (chosen.prefill_engine, chosen.decode_engine, chosen.mode) == ("p", "d", PUSH)
    assert chosen.terms["prefill_s"] == pytest.approx(1.0)
    assert chosen.terms["handoff_s"] == pytest.approx(0.105)
    assert chosen.ttft_s == pytest.approx(1.105)
    assert chosen.terms["decode_s"] == pytest.approx(1.0)
    assert chosen.cost == pytest.approx(1.0 * 0.01 + 1.0 * 0.005)


def test_a_prefill_engine_that_does_not_push_hands_off_by_pull_priced_whole() -> None:
    request = Request("t", prompt_tokens=10_000, max_output_tokens=100)
    quiet = engine("p", "n1", "prefill-gpu", Role.PREFILL, 10_000, 1, pushes=False)
    chosen = plan(request, Holdings(), [quiet, D], POLICY)
    # the decode node pulls all 10,000 tokens after the prefill: 1 s + 5 ms, not 0.1 s
    assert (chosen.mode, chosen.terms["handoff_s"]) == (PULL, pytest.approx(1.005))
    assert chosen.ttft_s == pytest.approx(2.005)


def test_a_measured_handoff_cost_keeps_a_small_saving_on_one_engine() -> None:
    """Engine a holds the prefix, decode engine b of the same class decodes a little faster
    (as measured): with the configured 5 ms a hand-off a -> b pays for 8 ms of decode saved;
    once hand-offs measured 50 ms (small engines: a second request, a KV load, a step), the
    request stays on a, which holds its prefix."""
    a = engine("a", "n1", "decode-gpu", Role.BOTH, 10_000, 100)
    b = engine("b", "n2", "decode-gpu", Role.DECODE, 10_000, 125)
    request = Request("t", prompt_tokens=1000, max_output_tokens=4)
    held = Holdings({"n1": 1000})
    # a alone: 40 ms of decode; a -> b: b pulls all 1,000 tokens (0.1 ms on this link),
    # plus the fixed cost, plus 32 ms of decode
    fast = dataclasses.replace(POLICY, link=Link(1e12, 100_000, 0.9))
    split = plan(request, held, [a, b], fast)
    assert (split.prefill_engine, split.decode_engine, split.terms["handoff_fixed_s"]) == (
        "a",
        "b",
        0.005,
    )
    measured = dataclasses.replace(fast, handoff_fixed_s=0.050)
    kept = plan(request, held, [a, b], measured)
    assert (kept.prefill_engine, kept.decode_engine, kept.mode) == ("a", "a", SINGLE)
    assert kept.terms["handoff_fixed_s"] == 0.0


def test_a_short_prompt_stays_on_one_engine_conditional_disaggregation() -> None:
    request = Request("t", prompt_tokens=10, max_output_tokens=100)
    chosen = plan(request, Holdings(), [P, D, MONO], POLICY)
    # mono: 10 / 2,000 = 5 ms; p+d: 1 ms + hand-off 0.1 ms + 5 ms
    assert (chosen.prefill_engine, chosen.decode_engine, chosen.mode) == ("mono", "mono", SINGLE)
    assert chosen.ttft_s == pytest.approx(0.005)


def test_a_large_hit_on_the_single_engine_node_beats_disaggregation() -> None:
    request = Request("t", prompt_tokens=10_000, max_output_tokens=100)
    held = Holdings({"n4": 9_900})
    chosen = plan(request, held, [P, D, MONO], POLICY)
    # mono: 100 uncached tokens at 2,000/s = 50 ms. p: pulling 9,900 tokens costs 0.99 s,
    # computing them 0.99 s too (tie: computed), so p+d takes about 1.1 s
    assert chosen.prefill_engine == "mono" and chosen.reused_tokens == 9_900
    assert chosen.ttft_s == pytest.approx(0.05)


def test_a_prefix_on_another_node_is_pulled_when_that_beats_computing_it() -> None:
    slow = engine("slow", "n1", "prefill-gpu", Role.PREFILL, 1_000, 1)
    request = Request("t", prompt_tokens=2_000, max_output_tokens=10)
    chosen = plan(request, Holdings({"n9": 1_000}), [slow, D], POLICY)
    # pulling 1,000 tokens: 0.1 s; computing them: 1 s
    assert chosen.pulled_tokens == 1_000 and chosen.reused_tokens == 1_000
    assert chosen.terms["pull_s"] == pytest.approx(0.1)
    assert chosen.terms["prefill_s"] == pytest.approx(1.0)


def test_a_fully_held_prompt_is_pulled_by_the_decode_node_with_nothing_to_compute() -> None:
    request = Request("t", prompt_tokens=1_000, max_output_tokens=10)
    chosen = plan(request, Holdings({"n1": 1_000}), [P, D], POLICY)
    assert chosen.mode == PULL and chosen.terms["prefill_s"] == 0
    assert chosen.terms["handoff_s"] == pytest.approx(0.1 + 0.005)  # all of it moves


def test_queued_tokens_send_the_request_elsewhere() -> None:
    busy = engine("busy", "n1", "prefill-gpu", Role.PREFILL, 10_000, 1, queued_tokens=50_000)
    idle = engine("idle", "n5", "prefill-gpu", Role.PREFILL, 5_000, 1)
    request = Request("t", prompt_tokens=5_000, max_output_tokens=10)
    chosen = plan(request, Holdings(), [busy, idle, D], POLICY)
    assert chosen.prefill_engine == "idle"  # 1 s against 5 s queued + 0.5 s


def test_batch_long_outputs_fall_back_to_cpu_decode_when_the_gpus_are_full() -> None:
    full = engine("d", "n2", "decode-gpu", Role.DECODE, 1, 100, free_kv_tokens=1_000)
    batch = Request("t", prompt_tokens=2_000, max_output_tokens=4_000, priority=Priority.BATCH)
    assert plan(batch, Holdings(), [P, full, CPU], POLICY).decode_engine == "cpu"
    # with room on the GPU, batch still picks the cheaper decode: 133 s * 0.001 < 40 s * 0.005
    assert plan(batch, Holdings(), [P, D, CPU], POLICY).decode_engine == "cpu"
    # an interactive request takes the fastest: 40 s of decode, not 133
    interactive = Request("t", prompt_tokens=2_000, max_output_tokens=4_000)
    assert plan(interactive, Holdings(), [P, D, CPU], POLICY).decode_engine == "d"
    # a class slower per token than its price saves is never the cheaper one
    slow_cpu = engine("cpu", "n3", "decode-cpu", Role.DECODE, 1, 10)  # 400 s * 0.001 > 0.2
    assert plan(batch, Holdings(), [P, D, slow_cpu], POLICY).decode_engine == "d"


def test_ties_are_broken_by_cost_then_load_then_engine_id() -> None:
    twin_a = engine("a", "n1", "decode-gpu", Role.BOTH, 1_000, 10)
    twin_b = engine("b", "n2", "decode-gpu", Role.BOTH, 1_000, 10)
    request = Request("t", prompt_tokens=100, max_output_tokens=10)
    for order in ([twin_a, twin_b], [twin_b, twin_a]):
        assert plan(request, Holdings(), order, POLICY).prefill_engine == "a"
    busy_a = dataclasses.replace(twin_a, running=3)
    assert plan(request, Holdings(), [busy_a, twin_b], POLICY).prefill_engine == "b"


def test_missing_engines_are_a_clear_error() -> None:
    request = Request("t", prompt_tokens=100, max_output_tokens=10)
    with pytest.raises(NoEngineError, match="prefills"):
        plan(request, Holdings(), [D], POLICY)
    with pytest.raises(NoEngineError, match="room"):
        plan(
            request,
            Holdings(),
            [P, engine("d", "n2", "x", Role.DECODE, 1, 1, free_kv_tokens=5)],
            POLICY,
        )
    with pytest.raises(NoEngineError):
        plan(request, Holdings(), [engine("x", "n", "c", Role.BOTH, 1, 1, healthy=False)], POLICY)


ROLES = st.sampled_from(list(Role))
ENGINES = st.lists(
    st.builds(
        EngineState,
        engine_id=st.text("abcdef", min_size=1, max_size=3),
        node_id=st.sampled_from(["n1", "n2", "n3"]),
        hardware_class=st.sampled_from(["prefill-gpu", "decode-gpu", "decode-cpu", "unknown"]),
        role=ROLES,
        prefill_tps=st.floats(1, 1e5),
        decode_tps=st.floats(1, 1e3),
        queued_tokens=st.integers(0, 10**6),
        free_kv_tokens=st.integers(0, 10**6),
        healthy=st.booleans(),
    ),
    max_size=6,
    unique_by=lambda e: e.engine_id,
)


@given(
    ENGINES,
    st.integers(0, 50_000),
    st.integers(0, 5_000),
    st.dictionaries(st.sampled_from(["n1", "n2", "n3"]), st.integers(0, 50_000)),
    st.sampled_from(list(Priority)),
)
def test_a_plan_never_names_an_unhealthy_or_unfit_engine(
    engines, prompt, output, held, priority
) -> None:
    request = Request("t", prompt, output, priority)
    try:
        chosen = plan(request, Holdings(held), engines, POLICY)
    except NoEngineError:
        fit = [
            e
            for e in engines
            if e.healthy and e.role.decodes() and e.free_kv_tokens >= request.budget_tokens
        ]
        assert not fit or not any(e.healthy and e.role.prefills() for e in engines)
        return
    by_id = {e.engine_id: e for e in engines}
    p, d = by_id[chosen.prefill_engine], by_id[chosen.decode_engine]
    assert p.healthy and d.healthy and p.role.prefills() and d.role.decodes()
    assert d.free_kv_tokens >= request.budget_tokens
    assert 0 <= chosen.reused_tokens <= prompt
    assert chosen.ttft_s == pytest.approx(
        sum(chosen.terms[k] for k in ("queue_s", "pull_s", "prefill_s", "handoff_s"))
    )
    assert chosen == plan(request, Holdings(held), list(reversed(engines)), POLICY)  # deterministic
