"""slice_pages: the pieces of a byte range of an object cover exactly that range, page by page."""

from __future__ import annotations

from array import array

import pytest

from kvfabric.memory.pages import slice_pages

PAGE = 16
PAGES = array("I", [7, 2, 9, 0, 4])  # out of order, as an allocator hands them out


def _view(page: int, start: int, end: int) -> tuple[int, int, int]:
    return (int(page), start, end)


def _bytes_of(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(page, byte) of every byte the pieces cover, in order."""
    return [(page, b) for page, start, end in pieces for b in range(start, end)]


@pytest.mark.parametrize("offset", [0, 1, PAGE - 1, PAGE, PAGE + 3, 3 * PAGE, 5 * PAGE])
@pytest.mark.parametrize("length", [0, 1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 3 * PAGE + 5])
def test_pieces_cover_exactly_the_range(offset: int, length: int) -> None:
    if offset + length > len(PAGES) * PAGE:
        with pytest.raises(ValueError, match="outside the object"):
            slice_pages(_view, PAGES, PAGE, offset, length)
        return
    pieces = slice_pages(_view, PAGES, PAGE, offset, length)
    want = [(PAGES[i // PAGE], i % PAGE) for i in range(offset, offset + length)]
    assert _bytes_of(pieces) == want
    # one piece per page touched, none empty
    assert len(pieces) == len({i // PAGE for i in range(offset, offset + length)})
    assert all(end > start for _, start, end in pieces)


def test_negative_ranges_are_refused() -> None:
    for offset, length in [(-1, 4), (0, -1)]:
        with pytest.raises(ValueError, match="outside the object"):
            slice_pages(_view, PAGES, PAGE, offset, length)
