"""Strided 3-D copies between two tensors; transposed ones through a compiled kernel.

Contract: :func:`copy` copies, for each :class:`Region`, the ``shape`` elements ``src``
addresses with ``(src_offset, src_strides)`` into those ``dst`` addresses with
``(dst_offset, dst_strides)``: what ``dst.as_strided(shape, dst_strides, dst.storage_offset()
+ dst_offset).copy_(...)`` of the matching ``src`` view does, bit for bit, without building
the views (building two views costs more than copying a 128-token block here). Offsets and
strides are in elements, relative to each tensor's first element, and must be non-negative.
Every addressed element must lie within its tensor's extent (its first to its last element),
else ``ValueError`` before anything is copied, on every path.

CPU tensors of one dtype among bfloat16, float16 and float32 go through the compiled kernel
``_strided.c`` (cache-tiled SIMD when the two sides have unit stride along different dims, a
transposed copy; memcpy of rows when both have it along the last; an element loop otherwise),
which checks the regions itself, in one call for all of them: per region, Python costs more
than copying a 128-token block here. When a region of ``dst`` overlaps itself or its ``src``
region, every region goes through ``Tensor.copy_`` of the two views (which refuses
overlapping writes), as does everything else, and installs that did not build the kernel (no
C compiler).

Why: torch and numpy copy a transposed view one element at a time, several times slower
than a plain copy, and vLLM's CPU cache stores K transposed inside each block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvfabric.memory import native

Strides = tuple[int, int, int]
Shape = tuple[int, int, int]

_KERNEL_ITEMSIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


class Region(NamedTuple):
    """One strided copy: ``shape`` elements, at an offset with strides on each side."""

    dst_offset: int
    dst_strides: Strides
    src_offset: int
    src_strides: Strides
    shape: Shape


def copy(dst: torch.Tensor, src: torch.Tensor, regions: Sequence[Region]) -> None:
    """Copy each region of ``src`` into ``dst``, in order; see the module docstring."""
    dst_extent, src_extent = _extent(dst), _extent(src)
    itemsize = _KERNEL_ITEMSIZE.get(dst.dtype)
    kernel = native.kernel
    if (
        kernel is not None
        and itemsize is not None
        and src.dtype is dst.dtype
        and dst.is_cpu
        and src.is_cpu
        and not (dst.requires_grad or src.requires_grad)
    ):
        # checks every region itself; False (nothing copied) when one overlaps
        if kernel.copy_regions(
            dst.data_ptr(), dst_extent, src.data_ptr(), src_extent, itemsize, regions
        ):
            return
    else:
        for region in regions:
            _check(region, dst_extent, src_extent)
    for region in regions:
        if min(region.shape):
            dst.as_strided(
                region.shape, region.dst_strides, dst.storage_offset() + region.dst_offset
            ).copy_(
                src.as_strided(
                    region.shape, region.src_strides, src.storage_offset() + region.src_offset
                )
            )


def _extent(tensor: torch.Tensor) -> int:
    """Elements from the tensor's first to just past its last (0 when empty)."""
    if tensor.is_contiguous():
        return tensor.numel()
    if not tensor.numel():
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def _check(region: Region, dst_extent: int, src_extent: int) -> None:
    """ValueError unless a non-empty region lies within both tensors' extents."""
    if min(region.shape) < 0:
        raise ValueError("shape must be non-negative")
    if not min(region.shape):
        return
    for name, offset, strides, extent in (
        ("dst", region.dst_offset, region.dst_strides, dst_extent),
        ("src", region.src_offset, region.src_strides, src_extent),
    ):
        if offset < 0 or min(strides) < 0:
            raise ValueError(f"{name}: offset and strides must be non-negative")
        last = sum((n - 1) * s for n, s in zip(region.shape, strides))
        if offset + last >= extent:
            raise ValueError(
                f"{name}: a region at {offset} lies outside the tensor's {extent} elements"
            )
