"""The logprob comparison the engine tests judge near-ties with (tests/support)."""

from __future__ import annotations

from logprob_bounds import compare, position_diff, top2_margin


def out(tokens: list[int], logprobs: list[dict[int, float]]) -> dict:
    return {"token_ids": tokens,
            "logprobs": [{str(t): lp for t, lp in p.items()} for p in logprobs]}


def test_equal_runs_differ_by_nothing() -> None:
    a = out([1, 2], [{1: -0.1, 5: -2.0}, {2: -0.3, 7: -1.5}])
    got = compare(a, a)
    assert got.max_logprob_diff == 0.0 and got.first_difference is None and got.within(0.0)


def test_a_flip_is_accepted_only_at_a_near_tie() -> None:
    ref = out([1, 2], [{1: -0.60, 3: -0.80}, {2: -0.1, 4: -3.0}])
    near = out([3, 9], [{3: -0.65, 1: -0.70}, {9: -0.1}])
    got = compare(ref, near)
    assert got.first_difference == 0 and abs(got.reference_margin - 0.2) < 1e-9
    assert got.within(0.16) and not got.within(0.05)  # margin 0.2 <= 2 * bound


def test_disjoint_top_k_lists_still_count() -> None:
    """A wrong load lists other tokens: the difference is bounded from below by the other
    run's least listed logprob, not read as 0."""
    assert position_diff({"1": -0.1, "2": -1.0}, {"8": -0.2, "9": -4.0}) >= 3.9
    assert top2_margin(out([1], [{1: -0.1, 2: -1.1}]), 0) == 1.0
