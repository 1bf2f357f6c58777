"""Comparing two greedy runs of an engine by their logprobs instead of a token on faith.

Engine results (tests/e2e/vllm/engine_runner.py, with ``logprobs``) carry per generated
position a map token id -> logprob for the chosen token and the top-k. Two runs whose
numerics differ a little (another batch shape, another tensor-parallel reduction order, KV
that went through fp8) produce slightly different logprobs; their greedy tokens part only at
a near-tie, where the two leading logprobs are closer than the perturbation. So a test bounds
the perturbation (a bound derived from an effect measured in the same run) and accepts a
differing token only at such a near-tie. A wrong load moves logprobs by far more than any
such bound (the negative controls show it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Comparison:
    """How one run's output differs from a reference output of the same prompt."""

    max_logprob_diff: float  # over tokens both list, on positions up to the first difference
    first_difference: int | None  # the first position whose generated token differs
    reference_margin: float | None  # the reference's top-2 gap at that position

    def within(self, bound: float) -> bool:
        """Logprobs within ``bound``, and a differing token only at a near-tie that a
        perturbation of ``bound`` on each of the two logprobs can flip."""
        if self.max_logprob_diff > bound:
            return False
        return self.reference_margin is None or self.reference_margin <= 2 * bound


def compare(reference: dict, other: dict, positions: int | None = None) -> Comparison:
    """Compare the first ``positions`` generated positions (all when None)."""
    worst = 0.0
    pairs = list(zip(reference["token_ids"], other["token_ids"]))[:positions]
    for position, (token_ref, token_other) in enumerate(pairs):
        lp_ref, lp_other = reference["logprobs"][position], other["logprobs"][position]
        worst = max(worst, position_diff(lp_ref, lp_other))
        if token_ref != token_other:
            return Comparison(worst, position, top2_margin(reference, position))
    return Comparison(worst, None, None)


def position_diff(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest logprob difference over the tokens either run lists at one position. A
    token only one lists lies below the other's least listed logprob, which bounds its
    difference from below (so disjoint top-k lists still count, as a wrong load gives)."""
    worst = 0.0
    for mine, theirs in ((a, b), (b, a)):
        floor = min(theirs.values())
        for token, logprob in mine.items():
            other = theirs.get(token)
            worst = max(
                worst, abs(logprob - other) if other is not None else max(0.0, logprob - floor)
            )
    return worst


def top2_margin(output: dict, position: int) -> float:
    """The gap between the two most likely tokens an output lists at ``position``."""
    top = sorted(output["logprobs"][position].values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def largest_diff(references: list[dict], others: list[dict], positions: int | None = None) -> float:
    """The largest logprob difference over prompts (each up to its first differing token)."""
    return max(
        (compare(a, b, positions).max_logprob_diff for a, b in zip(references, others)), default=0.0
    )


def deciding_diffs(reference: dict, other: dict) -> tuple[list[float], int | None]:
    """Per generated position, up to and including the first differing token: how far the
    logprobs of the reference's two leading tokens (the ones greedy decoding decides
    between) moved in the other run; and that first differing position (None if none)."""
    diffs: list[float] = []
    for position, (token_ref, token_other) in enumerate(
        zip(reference["token_ids"], other["token_ids"])
    ):
        lp_ref, lp_other = reference["logprobs"][position], other["logprobs"][position]
        leading = dict(sorted(lp_ref.items(), key=lambda item: -item[1])[:2])
        floor = min(lp_other.values())
        diffs.append(
            max(
                abs(lp - lp_other[t]) if t in lp_other else max(0.0, lp - floor)
                for t, lp in leading.items()
            )
        )
        if token_ref != token_other:
            return diffs, position
    return diffs, None


def gap_of_reference_token(reference: dict, other: dict, position: int = 0) -> float:
    """How far below its own top the other run puts the reference's token (0 when it is the
    other's choice too; a lower bound when the other does not list it)."""
    token = str(reference["token_ids"][position])
    listed = other["logprobs"][position]
    top = max(listed.values())
    return top - listed[token] if token in listed else top - min(listed.values())
