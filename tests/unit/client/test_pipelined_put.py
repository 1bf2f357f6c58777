"""How a pipelined put splits a batch into groups."""

from __future__ import annotations

import itertools

import pytest

from kvfabric.client.pipelined_put import GROWTH, groups


@pytest.mark.parametrize("count", [1, 2, 7, 16, 64, 100])
@pytest.mark.parametrize("first", [0, 1, 2, 5])
def test_groups_cover_every_item_once_in_order(count: int, first: int) -> None:
    spans = list(groups(count, first))
    assert spans[0][0] == 0 and spans[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(lo < hi for lo, hi in spans)


def test_groups_start_small_and_grow_fourfold() -> None:
    assert list(groups(16, 2)) == [(0, 2), (2, 10), (10, 16)]
    sizes = [hi - lo for lo, hi in groups(1000, 3)]
    assert sizes[:4] == [3, 3 * GROWTH, 3 * GROWTH**2, 3 * GROWTH**3]


def test_a_batch_not_worth_splitting_is_one_group() -> None:
    assert list(groups(16, 16)) == [(0, 16)]
