"""Strided 3-D copies: the compiled kernel and the torch fallback write the same bits as an
``as_strided`` copy, and both refuse regions outside their tensors."""

from __future__ import annotations

import pytest
import torch

from kvfabric.memory import native, strided
from kvfabric.memory.strided import Region

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {2: torch.int16, 4: torch.int32}


def test_the_install_built_the_kernel() -> None:
    # `pip install -e .` compiles kvfabric/memory/_strided.c; without it every copy below
    # would silently take the slow fallback.
    assert native.kernel is not None


def _random_bits(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included) viewed as ``dtype``."""
    bits = BITS[dtype.itemsize]
    info = torch.iinfo(bits)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, (numel,), dtype=bits, generator=generator).view(dtype)


def _expected(dst: torch.Tensor, src: torch.Tensor, region: Region) -> torch.Tensor:
    want = dst.clone()
    view = want.as_strided(region.shape, region.dst_strides, region.dst_offset)
    view.copy_(src.as_strided(region.shape, region.src_strides, region.src_offset))
    return want


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.dtype.itemsize])


# (name, region over a 20000-element src and dst): the kernel's cases, with edges that are
# not multiples of its 8x8 / 4x4 register tiles or its 64x64 cache tiles.
REGIONS = [
    # dst rows are src columns, as a gather of K from vLLM's CPU cache
    ("transposed", Region(5, (2000, 70, 1), 3, (2100, 1, 29), (3, 29, 70))),
    ("transposed, dst by columns", Region(7, (2100, 1, 29), 0, (2000, 70, 1), (3, 29, 70))),
    ("transposed, larger than a cache tile", Region(0, (0, 130, 1), 1, (0, 1, 140), (1, 133, 130))),
    ("transposed, one row", Region(11, (0, 64, 1), 2, (0, 1, 64), (1, 1, 64))),
    ("rows contiguous on both sides", Region(9, (2000, 96, 1), 4, (3000, 80, 1), (4, 17, 75))),
    ("any strides", Region(1, (3, 900, 17), 2, (5000, 7, 2), (4, 19, 13))),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "region"), REGIONS, ids=[name for name, _ in REGIONS])
def test_copy_writes_what_an_as_strided_copy_writes(
    copy_routine: str, dtype: torch.dtype, name: str, region: Region
) -> None:
    src = _random_bits(20000, dtype, seed=1)
    dst = _random_bits(20000, dtype, seed=2)
    want = _expected(dst, src, region)
    strided.copy(dst, src, [region])
    assert torch.equal(_bits(dst), _bits(want))  # every other element untouched, too


@pytest.mark.parametrize("dtype", DTYPES)
def test_regions_are_relative_to_each_tensors_first_element(
    copy_routine: str, dtype: torch.dtype
) -> None:
    # dst a column-strided view into the middle of a larger buffer; src a transposed view
    buffer = _random_bits(4 * 40 * 50, dtype, seed=3).view(4, 40, 50)
    dst = buffer[1:3, 5:35, 10:40]
    src = _random_bits(3 * 30 * 30, dtype, seed=4).view(3, 30, 30).transpose(1, 2)[1:]
    want_buffer = buffer.clone()
    want_buffer[1:3, 5:35, 10:40] = src
    strided.copy(dst, src, [Region(0, dst.stride(), 0, src.stride(), (2, 30, 30))])
    assert torch.equal(_bits(buffer), _bits(want_buffer))


def test_several_regions_in_one_call(copy_routine: str) -> None:
    src = _random_bits(4096, torch.bfloat16, seed=5)
    dst = torch.zeros(4096, dtype=torch.bfloat16)
    regions = [
        Region(0, (0, 32, 1), 0, (0, 1, 32), (1, 32, 32)),
        Region(1024, (0, 32, 1), 2048, (0, 32, 1), (1, 32, 32)),
    ]
    want = dst.clone()
    for region in regions:
        want = _expected(want, src, region)
    strided.copy(dst, src, regions)
    assert torch.equal(_bits(dst), _bits(want))


@pytest.mark.parametrize(
    ("name", "region"),
    [
        ("dst past the end", Region(1, (0, 10, 1), 0, (0, 10, 1), (1, 10, 10))),
        ("src past the end", Region(0, (0, 10, 1), 0, (0, 1, 11), (1, 10, 10))),
        ("negative offset", Region(-1, (0, 10, 1), 0, (0, 10, 1), (1, 2, 2))),
        ("negative stride", Region(50, (0, -10, 1), 0, (0, 10, 1), (1, 2, 2))),
        ("a stride that overflows 64 bits", Region(0, (0, 2**62, 1), 0, (0, 10, 1), (1, 5, 2))),
        (
            "an offset that overflows 64 bits",
            Region(0, (0, 10, 1), 2**63 - 2, (0, 10, 1), (1, 2, 2)),
        ),
    ],
)
def test_regions_outside_a_tensor_are_refused_before_anything_is_copied(
    copy_routine: str, name: str, region: Region
) -> None:
    src = _random_bits(100, torch.float16, seed=6)
    dst = torch.zeros(100, dtype=torch.float16)
    fine = Region(0, (0, 10, 1), 0, (0, 1, 10), (1, 10, 10))
    with pytest.raises((ValueError, OverflowError), match="outside|non-negative|too large"):
        strided.copy(dst, src, [fine, region])
    assert not dst.any()


def test_the_extent_of_a_strided_tensor_ends_at_its_last_element(copy_routine: str) -> None:
    # a [4, 4] window of a [4, 10] buffer spans 34 elements, its first to its last
    buffer = torch.zeros(4, 10, dtype=torch.float32)
    window = buffer[:, 3:7]
    src = torch.ones(1, dtype=torch.float32)
    strided.copy(window, src, [Region(33, (0, 0, 1), 0, (0, 0, 1), (1, 1, 1))])
    assert buffer[3, 6] == 1.0 and buffer.sum() == 1.0
    with pytest.raises(ValueError, match="outside"):
        strided.copy(window, src, [Region(34, (0, 0, 1), 0, (0, 0, 1), (1, 1, 1))])


def test_empty_regions_copy_nothing(copy_routine: str) -> None:
    src, dst = torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    strided.copy(dst, src, [Region(100, (1, 1, 1), 100, (1, 1, 1), (0, 5, 5))])
    assert not dst.any()


@pytest.mark.parametrize(
    ("name", "region"),
    [
        ("into its own source", Region(16, (0, 1, 32), 0, (0, 32, 1), (1, 32, 32))),
        ("onto itself", Region(0, (0, 0, 1), 0, (0, 8, 1), (1, 8, 8))),
    ],
)
def test_overlapping_destinations_are_torchs_error(
    copy_routine: str, name: str, region: Region
) -> None:
    buffer = _random_bits(4096, torch.bfloat16, seed=7)
    before = buffer.clone()
    with pytest.raises(RuntimeError, match="single memory location"):
        strided.copy(buffer, buffer, [region])
    assert torch.equal(_bits(buffer), _bits(before))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_other_dtypes_and_conversions_take_torch(copy_routine: str, dtype: torch.dtype) -> None:
    src = torch.arange(200, dtype=torch.float32)
    dst = torch.zeros(200, dtype=dtype)
    region = Region(3, (0, 12, 1), 1, (0, 1, 12), (1, 10, 12))
    strided.copy(dst, src, [region])
    assert torch.equal(dst, _expected(torch.zeros(200, dtype=dtype), src, region))
