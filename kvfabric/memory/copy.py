"""Scatter-gather copies between page views (numpy on host memory, torch on a device).

A stored object is a list of page pieces; callers hold flat buffers or tensors. These
helpers copy between the two without an intermediate buffer, one ``copyto`` / ``copy_``
per overlapping piece pair. Host pieces are numpy ``uint8`` views; device pieces are torch
``uint8`` tensors; mixing them goes through ``torch.from_numpy`` (a view, not a copy).

Host-to-host copies go to the compiled routine of ``_strided.c`` when the install built it:
one call for all the piece pairs, the GIL released, and a copy loop of its own instead of
memcpy, whose ``rep movsb`` runs at a third of the memory bandwidth out of 4 KiB-paged arenas
on AMD EPYC hosts (``bytecopy.h`` says what was measured). Copies of at least
:data:`STREAM_MIN_BYTES` store non-temporally (whole objects written into the store, not
read back at once), except where the caller says the destination is read soon: a load
into an engine's buffers, which its next forward pass reads. Streaming those stores cost
8% of a 4 MiB get on the Intel host (0.905 -> 0.834 of ``np.copyto``), and it doubles
the throughput of a put into a 4 KiB-paged arena there (0.70 -> 1.13).

:func:`gather_runs` copies evenly spaced runs of an object's bytes (a tensor-parallel rank's
heads of every layer) out of host pieces in one call of the compiled routine of
``_strided.c`` when the install built it: per run, a Python-level copy costs about as much
as copying 10 KiB here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric.memory import native

Piece = Any  # numpy uint8 view or torch uint8 tensor

# A whole 4 MiB object streams; a layer of one (128 KiB here) or a head range stays cached.
STREAM_MIN_BYTES = 1 << 20
NEVER_STREAM = (1 << 63) - 1  # a stream_min no copy reaches


def as_bytes_view(buffer: Any) -> Piece:
    """A flat uint8 view of a buffer, numpy array or torch tensor (never a copy)."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        return buffer.reshape(-1).view(np.uint8)
    if _is_tensor(buffer):
        if not buffer.is_contiguous():
            raise ValueError("tensor must be contiguous")
        return buffer.reshape(-1).view(_torch().uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def total_bytes(pieces: Sequence[Piece]) -> int:
    return sum(nbytes_of(p) for p in pieces)


def copy_pieces(dst: Sequence[Piece], src: Sequence[Piece], *, read_soon: bool = False) -> int:
    """Copy the concatenation of ``src`` into the concatenation of ``dst`` (equal totals,
    else ValueError before anything is copied); returns the bytes copied. ``read_soon``:
    the caller reads ``dst`` next, so a large copy keeps it in the cache (never streamed)."""
    kernel = native.kernel
    if kernel is not None and _all_host(dst) and _all_host(src):
        return int(kernel.copy_pieces(dst, src, NEVER_STREAM if read_soon else STREAM_MIN_BYTES))
    src_sizes = [nbytes_of(p) for p in src]
    dst_sizes = [nbytes_of(p) for p in dst]
    total = sum(src_sizes)
    if total != sum(dst_sizes):
        raise ValueError(f"size mismatch: source {total} bytes, destination {sum(dst_sizes)}")
    if len(dst) == 1 or len(src) == 1:  # the common case: one flat buffer on one side
        _scatter(dst, dst_sizes, src, src_sizes)
        return total
    di = si = 0
    doff = soff = 0
    while di < len(dst) and si < len(src):
        n = min(dst_sizes[di] - doff, src_sizes[si] - soff)
        if n:
            _copy(dst[di][doff : doff + n], src[si][soff : soff + n])
        doff += n
        soff += n
        if doff == dst_sizes[di]:
            di, doff = di + 1, 0
        if soff == src_sizes[si]:
            si, soff = si + 1, 0
    return total


def _scatter(
    dst: Sequence[Piece], dst_sizes: list[int], src: Sequence[Piece], src_sizes: list[int]
) -> None:
    """One side is a single buffer: slice it once per piece of the other side."""
    if len(dst) == 1:
        flat, pieces, sizes, into_flat = dst[0], src, src_sizes, True
    else:
        flat, pieces, sizes, into_flat = src[0], dst, dst_sizes, False
    offset = 0
    for piece, size in zip(pieces, sizes):
        window = flat[offset : offset + size]
        if into_flat:
            _copy(window, piece)
        else:
            _copy(piece, window)
        offset += size


def _copy(dst: Piece, src: Piece) -> None:
    dst_np, src_np = isinstance(dst, np.ndarray), isinstance(src, np.ndarray)
    if dst_np and src_np:
        np.copyto(dst, src)
        return
    torch = _torch()
    dst_t = torch.from_numpy(dst) if dst_np else dst
    src_t = torch.from_numpy(src) if src_np else src
    dst_t.copy_(src_t)


def gather_runs(
    into: np.ndarray,
    pieces: Sequence[np.ndarray],
    first: int,
    outer: tuple[int, int],
    inner: tuple[int, int],
    length: int,
) -> None:
    """Copy the runs of ``length`` bytes at ``first + a * outer[1] + b * inner[1]`` (for
    ``a < outer[0]``, ``b < inner[0]``, in that order) of the concatenation of host
    ``pieces`` (1-D ``uint8`` views) back to back into flat ``uint8`` ``into``.

    ValueError, before anything is copied, unless every run lies within the pieces and
    ``into`` holds them all; offsets, counts and strides must be non-negative."""
    if native.kernel is not None:
        native.kernel.gather_runs(
            into, pieces, first, outer[0], outer[1], inner[0], inner[1], length
        )
        return
    if min(first, *outer, *inner, length) < 0:
        raise ValueError("offsets, counts and strides must be non-negative")
    if not (outer[0] and inner[0] and length):
        return
    last = first + (outer[0] - 1) * outer[1] + (inner[0] - 1) * inner[1]
    if (
        last + length > sum(piece.nbytes for piece in pieces)
        or outer[0] * inner[0] * length > into.nbytes
    ):
        raise ValueError("a run lies outside the pieces or the destination")
    index, piece_start = 0, 0  # the piece holding the current position, and its offset
    piece_end = pieces[0].nbytes
    offset = 0
    for a in range(outer[0]):
        for b in range(inner[0]):
            position = first + a * outer[1] + b * inner[1]
            if position < piece_start:  # runs go backwards: search from the start
                index, piece_start, piece_end = 0, 0, pieces[0].nbytes
            remaining = length
            while remaining:
                while position >= piece_end:
                    index += 1
                    piece_start, piece_end = piece_end, piece_end + pieces[index].nbytes
                n = min(remaining, piece_end - position)
                inner_at = position - piece_start
                np.copyto(into[offset : offset + n], pieces[index][inner_at : inner_at + n])
                offset += n
                position += n
                remaining -= n


def _all_host(pieces: Sequence[Piece]) -> bool:
    return all(isinstance(p, np.ndarray) for p in pieces)


def nbytes_of(piece: Piece) -> int:
    return piece.nbytes if isinstance(piece, np.ndarray) else piece.numel()


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "is_contiguous")


def _torch() -> Any:
    import torch  # only when a device piece or tensor is involved

    return torch


# Clients map readers' pages PROT_READ (kvfabric/client/arenas.py), so tensors made from
# them are read-only; they are only ever copied from, which torch's warning cannot know.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)
