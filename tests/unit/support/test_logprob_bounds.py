"""The logprob comparison the engine tests judge near-ties with (tests/support)."""

from __future__ import annotations

from logprob_bounds import compare, position_diff, top2_margin


def out(tokens: list[int], logprobs: list[dict[int, float]]) -> dict:
    return {
        "token_ids": tokens,
        "logprobs": [{str(t): lp for t, lp in p.items()} for p in logprobs],
    }


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


def test_deciding_diffs_stop_at_the_first_flip_and_gaps_measure_the_reference_token() -> None:
    from logprob_bounds import deciding_diffs, gap_of_reference_token

    ref = out([1, 2, 3], [{1: -0.1, 4: -2.0}, {2: -0.5, 5: -0.6}, {3: -0.1, 6: -4.0}])
    other = out([1, 5, 3], [{1: -0.2, 4: -1.8}, {5: -0.5, 2: -0.55}, {3: -0.1, 6: -4.0}])
    diffs, first = deciding_diffs(ref, other)
    assert first == 1 and len(diffs) == 2 and abs(diffs[0] - 0.2) < 1e-9
    assert abs(gap_of_reference_token(ref, other, 1) - 0.05) < 1e-9
    assert gap_of_reference_token(ref, out([9], [{9: -0.1, 8: -3.0}])) == 2.9  # unlisted
