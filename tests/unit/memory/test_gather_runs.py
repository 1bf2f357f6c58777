"""gather_runs: evenly spaced runs out of host pieces, the compiled routine and the Python
fallback byte for byte against slicing the concatenation; bad runs refused before copying."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvfabric.memory.copy import gather_runs


def _pieces(sizes: list[int], seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Random bytes cut into views of one buffer, as an arena's pages are."""
    whole = np.random.default_rng(seed).integers(0, 256, sum(sizes), dtype=np.uint8)
    bounds = np.cumsum([0, *sizes])
    return whole, [whole[a:b] for a, b in itertools.pairwise(bounds)]


def _expected(
    whole: np.ndarray, first: int, outer: tuple[int, int], inner: tuple[int, int], length: int
) -> np.ndarray:
    runs = [
        whole[first + a * outer[1] + b * inner[1] :][:length]
        for a in range(outer[0])
        for b in range(inner[0])
    ]
    return np.concatenate(runs) if runs else np.empty(0, np.uint8)


CASES = [
    # (name, piece sizes, first, outer, inner, length)
    ("heads of every layer and plane", [4096] * 16, 256, (8, 8192), (2, 4096), 512),
    ("runs across uneven pieces", [100, 1, 0, 3000, 77, 5000], 33, (3, 2000), (2, 900), 1234),
    ("a run spanning several pieces", [10] * 50, 5, (1, 0), (2, 200), 290),
    ("runs going backwards", [1000, 1000, 1000], 10, (2, 20), (2, 2000), 500),
    ("one whole piece", [64, 64], 64, (1, 0), (1, 0), 64),
]


@pytest.mark.parametrize(
    ("name", "sizes", "first", "outer", "inner", "length"), CASES, ids=[case[0] for case in CASES]
)
def test_runs_are_the_bytes_of_the_concatenation(
    copy_routine: str,
    name: str,
    sizes: list[int],
    first: int,
    outer: tuple[int, int],
    inner: tuple[int, int],
    length: int,
) -> None:
    whole, pieces = _pieces(sizes, seed=len(sizes))
    want = _expected(whole, first, outer, inner, length)
    into = np.zeros(want.nbytes + 7, dtype=np.uint8)
    gather_runs(into, pieces, first, outer, inner, length)
    assert np.array_equal(into[: want.nbytes], want)
    assert not into[want.nbytes :].any()  # nothing written past the runs


def test_read_only_pieces_are_read(copy_routine: str) -> None:
    whole, pieces = _pieces([300, 300], seed=1)
    for piece in pieces:
        piece.flags.writeable = False
    into = np.zeros(200, dtype=np.uint8)
    gather_runs(into, pieces, 250, (2, 100), (1, 0), 100)
    assert np.array_equal(into, whole[250:450])


@pytest.mark.parametrize(
    ("name", "first", "outer", "inner", "length", "into_size"),
    [
        ("the last run ends past the pieces", 0, (2, 300), (1, 0), 101, 202),
        ("the destination is too small", 0, (2, 100), (1, 0), 100, 199),
        ("a negative stride", 150, (2, -100), (1, 0), 10, 20),
        ("a negative length", 0, (1, 0), (1, 0), -1, 20),
        ("strides that overflow 64 bits", 0, (3, 2**62), (3, 2**62), 10, 90),
        ("counts that overflow 64 bits", 0, (2**40, 0), (2**40, 0), 2**10, 90),
    ],
)
def test_bad_runs_are_refused_before_anything_is_copied(
    copy_routine: str,
    name: str,
    first: int,
    outer: tuple[int, int],
    inner: tuple[int, int],
    length: int,
    into_size: int,
) -> None:
    _, pieces = _pieces([200, 200], seed=2)
    into = np.zeros(into_size, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside|non-negative"):
        gather_runs(into, pieces, first, outer, inner, length)
    assert not into.any()


def test_no_runs_copy_nothing(copy_routine: str) -> None:
    into = np.zeros(8, dtype=np.uint8)
    gather_runs(into, [], 0, (0, 100), (3, 10), 50)
    gather_runs(into, [], 0, (3, 100), (3, 10), 0)
    assert not into.any()
