"""Scatter-gather copies between numpy page views and torch tensors, by the compiled kernel
where the install built it and by numpy / torch where it did not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stream_recorder import StreamRecorder

from kvfabric.memory import native
from kvfabric.memory.copy import STREAM_MIN_BYTES, as_bytes_view, copy_pieces

needs_kernel = pytest.mark.skipif(native.kernel is None, reason="the C kernel was not built")


@pytest.fixture(params=["kernel", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test below runs on both copy paths."""
    if request.param == "kernel" and native.kernel is None:
        pytest.skip("the C kernel was not built")
    if request.param == "python":
        monkeypatch.setattr(native, "kernel", None)
    return str(request.param)


def split(buf: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    out, start = [], 0
    for n in sizes:
        out.append(buf[start : start + n])
        start += n
    return out


def test_copy_between_misaligned_piece_lists(path: str) -> None:
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


@pytest.mark.parametrize("total", [1023, 1024, 70_001, STREAM_MIN_BYTES + 77])
@pytest.mark.parametrize("skew", [0, 1, 31])
def test_every_size_and_alignment_lands_exactly(path: str, total: int, skew: int) -> None:
    """Sizes below and above the vector loop's minimum (1 KiB) and the streaming threshold,
    destinations off the 32-byte alignment the streamed stores need, an empty piece: every
    byte lands and none beside the destination moves."""
    rng = np.random.default_rng(total + skew)
    src = rng.integers(0, 256, total + 5, dtype=np.uint8)[5:]
    backing = np.full(total + 64, 0xAB, dtype=np.uint8)
    dst = backing[skew : skew + total]
    third = total // 3
    assert copy_pieces([dst[:third], dst[third:third], dst[third:]], [src]) == total
    assert np.array_equal(dst, src)
    assert (backing[:skew] == 0xAB).all() and (backing[skew + total :] == 0xAB).all()


def test_size_mismatch_is_an_error(path: str) -> None:
    with pytest.raises(ValueError, match="size mismatch"):
        copy_pieces([np.zeros(4, np.uint8)], [np.zeros(5, np.uint8)])


@needs_kernel
def test_host_copies_take_the_kernel_not_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host pieces go to one kernel call; negative control: without the kernel, the same copy
    goes through numpy, which this test has broken."""

    def broken(*_: object, **__: object) -> None:
        raise AssertionError("np.copyto called")

    monkeypatch.setattr(np, "copyto", broken)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    copy_pieces(split(dst, [1000, 3096]), split(src, [2048, 2048]))
    assert np.array_equal(dst, src)
    monkeypatch.setattr(native, "kernel", None)
    with pytest.raises(AssertionError, match="np.copyto called"):
        copy_pieces(split(dst, [1000, 3096]), split(src, [2048, 2048]))


@needs_kernel
def test_a_load_never_streams_and_a_large_store_copy_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the caller reads next (``read_into``: an engine's buffers) stays in the cache: its
    copy asks for a streaming threshold no copy reaches; a copy into the store streams from
    :data:`STREAM_MIN_BYTES`."""
    recorder = StreamRecorder(native.kernel)
    monkeypatch.setattr(native, "kernel", recorder)
    src = np.random.default_rng(0).integers(0, 256, 2 * STREAM_MIN_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    copy_pieces(split(dst, [STREAM_MIN_BYTES] * 2), [src])
    copy_pieces([dst], split(src, [STREAM_MIN_BYTES] * 2), read_soon=True)
    assert np.array_equal(dst, src)
    put_min, load_min = recorder.stream_min
    assert put_min == STREAM_MIN_BYTES <= src.nbytes
    assert load_min > 1 << 62


@needs_kernel
def test_the_kernel_refuses_a_read_only_destination() -> None:
    src = np.ones(2048, np.uint8)
    dst = np.zeros(2048, np.uint8)
    dst.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        copy_pieces([dst], [src])
    assert not dst.any()


def test_views_are_not_copies() -> None:
    arr = np.zeros((2, 3), dtype=np.float32)
    view = as_bytes_view(arr)
    view[:4] = 255
    assert arr[0, 0] != 0
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes_view(arr.T)
    assert as_bytes_view(b"abc").tolist() == [97, 98, 99]
