"""Scatter-gather copies between numpy page views and torch tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric.memory.copy import as_bytes_view, copy_pieces


def split(buf: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    out, start = [], 0
    for n in sizes:
        out.append(buf[start : start + n])
        start += n
    return out


def test_copy_between_misaligned_piece_lists() -> None:
    src = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    copy_pieces(split(dst, [300, 300, 400]), split(src, [7, 500, 1, 492]))
    assert np.array_equal(dst, src)


def test_copy_mixes_numpy_and_torch() -> None:
    src = torch.arange(512, dtype=torch.int16)
    dst = np.zeros(1024, dtype=np.uint8)
    copy_pieces(split(dst, [100, 924]), [as_bytes_view(src)])
    assert np.array_equal(dst.view(np.int16), np.arange(512, dtype=np.int16))
    back = torch.zeros(1024, dtype=torch.uint8)
    copy_pieces([back[:10], back[10:]], split(dst, [1000, 24]))
    assert torch.equal(back.view(torch.int16), src)


def test_size_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="size mismatch"):
        copy_pieces([np.zeros(4, np.uint8)], [np.zeros(5, np.uint8)])


def test_views_are_not_copies() -> None:
    arr = np.zeros((2, 3), dtype=np.float32)
    view = as_bytes_view(arr)
    view[:4] = 255
    assert arr[0, 0] != 0
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes_view(arr.T)
    assert as_bytes_view(b"abc").tolist() == [97, 98, 99]
