"""PageViewer: views of an object's bytes in a mapped arena, one per range when the
object's pages are one ascending run, one per page piece otherwise; the same bytes either way."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from kvfabric.client.arenas import PageViewer

PAGE = 8
FLAT = np.arange(16 * PAGE, dtype=np.uint8)


def expected(pages: list[int], offset: int, length: int) -> bytes:
    return b"".join(bytes(FLAT[p * PAGE : (p + 1) * PAGE]) for p in pages)[offset : offset + length]


@pytest.mark.parametrize("pages", [[2, 3, 4, 5], [5, 4, 3, 2], [1, 3, 4, 6], [9, 8, 11, 10]])
@pytest.mark.parametrize(
    "offset, length", [(0, 4 * PAGE), (3, 17), (PAGE, PAGE), (5, 0), (PAGE - 1, 2)]
)
def test_pieces_hold_the_objects_bytes_in_order(pages, offset, length) -> None:
    pieces = PageViewer(FLAT, PAGE, array("I", pages)).pieces(offset, length)
    assert b"".join(bytes(p) for p in pieces) == expected(pages, offset, length)
    assert all(np.shares_memory(p, FLAT) for p in pieces)  # views, never copies


def test_an_ascending_run_is_one_view_and_scattered_pages_are_one_per_page() -> None:
    run = PageViewer(FLAT, PAGE, array("I", [2, 3, 4, 5]))
    assert len(run.pieces(3, 3 * PAGE)) == 1
    scattered = PageViewer(FLAT, PAGE, array("I", [2, 4, 3, 5]))
    assert len(scattered.pieces(3, 3 * PAGE)) == 4


@pytest.mark.parametrize("pages", [[2, 3], [3, 2]])
def test_ranges_outside_the_object_are_refused(pages) -> None:
    viewer = PageViewer(FLAT, PAGE, array("I", pages))
    for offset, length in ((PAGE, 2 * PAGE), (-1, 4), (0, 2 * PAGE + 1)):
        with pytest.raises(ValueError, match="outside the object"):
            viewer.pieces(offset, length)
