"""Host / device pieces of a payload as torch tensors, and the dtypes conversion handles.

The shared ground of :mod:`kvfabric.convert.dtype` and :mod:`kvfabric.convert.fp8`: which KV
dtypes map to which torch dtype (:func:`kv_dtype`, :func:`torch_dtype`, :func:`convertible`),
merging adjacent page views into runs (:func:`coalesce`) and copying runs into a flat byte
tensor (:func:`copy_runs`). Pure memory operations; unknown dtypes raise
:class:`~kvfabric.errors.SpecError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvfabric.errors import PayloadSizeError, SpecError
from kvfabric.memory.copy import Piece, nbytes_of
from kvfabric.spec import KVDtype

_TORCH = {
    KVDtype.BFLOAT16: torch.bfloat16,
    KVDtype.FLOAT16: torch.float16,
    KVDtype.FLOAT32: torch.float32,
    KVDtype.FLOAT8_E4M3: torch.float8_e4m3fn,
    KVDtype.UINT8: torch.uint8,
}
_FROM_TORCH = {value: key for key, value in _TORCH.items()}


def kv_dtype(dtype: Any) -> KVDtype:
    """The :class:`KVDtype` of a name (``"bf16"``, ``"torch.float16"``), KVDtype or torch dtype."""
    if isinstance(dtype, torch.dtype):
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            known = ", ".join(str(t) for t in _TORCH.values())
            raise SpecError(f"unsupported KV dtype {dtype}; expected one of: {known}") from None
    if not isinstance(dtype, (str, KVDtype)):
        known = ", ".join(d.value for d in KVDtype)
        raise SpecError(
            f"a dtype must be a name, a KVDtype or a torch.dtype ({known}), got {dtype!r}"
        )
    return KVDtype.parse(dtype)


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a KV dtype given in any form :func:`kv_dtype` accepts."""
    return _TORCH[kv_dtype(dtype)]


def convertible(dtype: Any) -> torch.dtype:
    """The torch dtype of ``dtype`` if it converts element by element; SpecError otherwise."""
    kind = kv_dtype(dtype)
    if not kind.is_float:  # float8 needs its scales; opaque bytes are not numbers
        plain = ", ".join(d.value for d in KVDtype if d.is_float)
        raise SpecError(
            f"{kind.value} payloads carry per-head scales: read them with "
            f"kvfabric.convert.fp8, not as plain {plain}"
        )
    return _TORCH[kind]


def coalesce(pieces: Sequence[Piece]) -> list[Piece]:
    """``pieces`` with every run of adjacent views of one buffer merged into one view.

    Pages of an arena that happen to be consecutive (the common case for an object written
    into a fresh arena) become one piece: one copy instead of one per page, and a chance of
    handing out a view instead of a copy. Empty pieces are dropped."""
    out: list[Piece] = []
    end = -1  # address just past the last host piece of ``out``
    for piece in pieces:
        if not nbytes_of(piece):
            continue
        if isinstance(piece, np.ndarray):
            address = piece.ctypes.data if piece.ndim == 1 and piece.strides == (1,) else -2
            merged = _merge_host(out[-1], piece) if out and address == end else None
            end = address + piece.nbytes if address >= 0 else -1
        else:
            end = -1
            merged = _merge_device(out[-1], piece) if out else None
        if merged is None:
            out.append(piece)
        else:
            out[-1] = merged
    return out


def _merge_host(a: Piece, b: np.ndarray) -> np.ndarray | None:
    """One view covering host pieces ``a`` then ``b`` (adjacent in memory) if both are views
    of one buffer, else None."""
    root = b.base
    if (
        not isinstance(a, np.ndarray)
        or a.base is not root
        or not isinstance(root, np.ndarray)
        or not root.flags.c_contiguous
    ):
        return None
    # a slice of the buffer both are views of: its base stays that buffer, so the merged
    # piece merges again with the next one
    start = b.ctypes.data - a.nbytes - root.ctypes.data
    merged = root.reshape(-1).view(np.uint8)[start : start + a.nbytes + b.nbytes]
    return merged if merged.base is root else None


def _merge_device(a: Piece, b: Piece) -> Piece | None:
    """One view covering tensor pieces ``a`` then ``b`` if adjacent in one storage."""
    if (
        not isinstance(a, torch.Tensor)
        or not isinstance(b, torch.Tensor)
        or a.dim() != 1
        or b.dim() != 1
        or a.stride(0) != 1
        or b.stride(0) != 1
        or a.device != b.device
        or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        or a.storage_offset() + a.numel() != b.storage_offset()
    ):
        return None
    return a.as_strided((a.numel() + b.numel(),), (1,))


def as_tensor(piece: Piece) -> torch.Tensor:
    """A host piece as a tensor sharing its memory; a device piece as is."""
    if isinstance(piece, torch.Tensor):
        return piece
    if not piece.flags.writeable:
        # A read-only mapping: torch has no read-only tensors and warns; we never write to it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(piece)
    return torch.from_numpy(piece)


def copy_runs(dst: torch.Tensor, runs: Sequence[Piece]) -> None:
    """Copy the concatenated ``runs`` into flat uint8 ``dst``."""
    host = dst.device.type == "cpu"
    dst_np = dst.numpy() if host else None
    offset = 0
    for run in runs:
        n = nbytes_of(run)
        if dst_np is not None and isinstance(run, np.ndarray):
            np.copyto(dst_np[offset : offset + n], run)
        else:
            dst[offset : offset + n].copy_(as_tensor(run))
        offset += n


def check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise unless ``out`` is a contiguous tensor of ``shape`` and ``dtype``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise SpecError(f"out is {out.dtype}, the requested dtype is {dtype}")
    if tuple(out.shape) != shape:
        raise PayloadSizeError(f"out has shape {list(out.shape)}, expected {list(shape)}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
