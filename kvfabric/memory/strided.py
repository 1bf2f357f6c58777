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
transposed copy; memcpy of rows when both have it along the last; an element loop otherwise)
unless a region of ``dst`` overlaps itself or its ``src`` region. Everything else, and
installs that did not build the kernel (no C compiler), goes through ``Tensor.copy_`` of the
two views.

Why: torch and numpy copy a transposed view one element at a time, several times slower
than a plain copy, and vLLM's CPU cache stores K transposed inside each block.
"""

from __future__ import annotations

import functools
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
    compiled = native.kernel if itemsize is not None and src.dtype is dst.dtype and dst.is_cpu \
        and src.is_cpu and not (dst.requires_grad or src.requires_grad) else None
    dst_ptr, src_ptr = (dst.data_ptr(), src.data_ptr()) if compiled is not None else (0, 0)
    planned = []  # (the kernel's arguments, or None for torch; the region), all checked first
    for region in regions:
        dst_offset, dst_strides, src_offset, src_strides, shape = region
        n0, n1, n2 = shape
        if n0 < 0 or n1 < 0 or n2 < 0:
            raise ValueError(f"shape must be non-negative, got {shape}")
        if not (n0 and n1 and n2):
            continue
        dst_last = _last(dst_extent, "dst", dst_offset, dst_strides, shape)
        src_last = _last(src_extent, "src", src_offset, src_strides, shape)
        args = None
        if compiled is not None and itemsize is not None:
            to = dst_ptr + dst_offset * itemsize
            start = src_ptr + src_offset * itemsize
            if (to + (dst_last + 1) * itemsize <= start or start + (src_last + 1) * itemsize <= to) \
                    and not _self_overlapping(dst_strides, shape):
                args = (to, start, itemsize, n0, n1, n2, *dst_strides, *src_strides)
        planned.append((args, region))
    for args, region in planned:
        if args is not None and compiled is not None:
            compiled.copy(*args)
        else:
            dst.as_strided(region.shape, region.dst_strides,
                           dst.storage_offset() + region.dst_offset).copy_(
                src.as_strided(region.shape, region.src_strides,
                               src.storage_offset() + region.src_offset))


def _extent(tensor: torch.Tensor) -> int:
    """Elements from the tensor's first to just past its last (0 when empty)."""
    if tensor.is_contiguous():
        return tensor.numel()
    if not tensor.numel():
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def _last(extent: int, name: str, offset: int, strides: Strides, shape: Shape) -> int:
    """Elements from a non-empty region's first to its last; ValueError unless the region
    lies within a tensor of ``extent`` elements."""
    s0, s1, s2 = strides
    if offset < 0 or s0 < 0 or s1 < 0 or s2 < 0:
        raise ValueError(f"{name}: offset and strides must be non-negative")
    last = (shape[0] - 1) * s0 + (shape[1] - 1) * s1 + (shape[2] - 1) * s2
    if offset + last >= extent:
        raise ValueError(f"{name}: elements [{offset}, {offset + last}] lie outside the "
                         f"tensor's {extent}")
    return last


@functools.lru_cache(maxsize=256)  # a caller repeats a few (strides, shape) pairs
def _self_overlapping(strides: Strides, shape: Shape) -> bool:
    """Whether two indices may address one element (a sufficient test, by sorted strides)."""
    reach = 0  # offset of the last element the dims so far address
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False
