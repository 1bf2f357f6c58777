"""Dtype conversion of canonical KV on read: bfloat16, float16 and float32 in any direction.

A consumer that runs in another dtype than the producer (bf16 KV into an fp32 CPU model, an
fp16-only accelerator reading bf16 KV) converts while it copies the KV out of the fabric:

* :func:`convert_pieces` turns the zero-copy pieces of a layer, a head range or a whole payload
  (what ``reader.layer_pieces(layer, heads=...)`` / ``reader.pieces()`` return: numpy ``uint8``
  views of host pages, or torch ``uint8`` tensors of a device pool) into a tensor of a given
  shape in the requested dtype. When the dtype does not change and the pieces are one
  contiguous run of memory (adjacent pages of one arena count), the result is a **view** of the
  stored bytes (zero copy; it aliases the pages, so it is valid only while the reader holds the
  object pinned). Otherwise it is one pass: each piece is converted straight into its slice of
  the result (or of ``out``), with no intermediate buffer.
* :func:`read_layer` / :func:`read_payload` do the same from a reader, taking the stored dtype
  and the shape from the reader's layout: ``[planes, heads, tokens, head_dim]`` for a layer
  (or a head range of it), ``[layers, planes, heads, tokens, head_dim]`` for a payload.
* :func:`write_layer` is the producer's side: a canonical tensor in any of those dtypes into
  a writer's layer (or head range), converted to the stored dtype on the way.
  :func:`layer_in_place` spares that copy where it can: the writer's layer as a tensor that
  aliases its pages, for a producer that gathers its KV straight into them.
* :func:`convert_tensor` converts a canonical tensor already in memory (a view when nothing
  changes).

A float8 (e4m3) namespace stores per-head scales with its values (:mod:`kvfabric.convert.fp8`):
:func:`read_layer` / :func:`read_payload` dequantize it to the requested dtype (which it
must name: there is no plain float8 tensor to hand out) and :func:`write_layer` quantizes
into it; the piece-level functions here refuse it. Unknown dtypes raise
:class:`~kvfabric.errors.SpecError`;
pieces or buffers whose byte count does not match the requested shape raise
:class:`~kvfabric.errors.PayloadSizeError` (both are ``ValueError``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvfabric.convert import fp8
from kvfabric.convert.pieces import as_tensor, check_out, coalesce, convertible, copy_runs
from kvfabric.errors import PayloadSizeError, SpecError
from kvfabric.memory.copy import Piece, copy_pieces, gather_runs, nbytes_of
from kvfabric.payload import HeadRange, PayloadReader, PayloadWriter
from kvfabric.spec import ChunkLayout, KVDtype


def convert_pieces(
    pieces: Sequence[Piece],
    stored: Any,
    requested: Any = None,
    shape: Sequence[int] | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bytes of ``pieces`` (stored as ``stored``) as a ``requested``-dtype tensor of ``shape``.

    ``requested`` defaults to ``stored``; ``shape`` defaults to 1-D. Without ``out``, the result
    is a view of the pieces when the dtype does not change and the pieces are one contiguous
    run of memory, else a new tensor (on the pieces' device). With ``out`` (contiguous, of
    ``shape`` and the requested dtype, on the pieces' device or on the host for host pieces)
    the data is converted into it and ``out`` is returned.
    """
    src = convertible(stored)
    dst = src if requested is None else convertible(requested)
    total = sum(nbytes_of(p) for p in pieces)
    itemsize = src.itemsize
    if total % itemsize:
        raise PayloadSizeError(f"{total} bytes are not a whole number of {src} elements")
    numel = total // itemsize
    if shape is None:
        shape = (numel,) if out is None else tuple(out.shape)
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape) or math.prod(shape) != numel:
        raise PayloadSizeError(
            f"{total} bytes of {src} hold {numel} elements, not the "
            f"{math.prod(shape)} of shape {list(shape)}"
        )
    if out is not None:
        check_out(out, shape, dst)
    runs = coalesce(pieces)
    if out is None and len(runs) == 1:
        whole = as_tensor(runs[0]).view(src).view(shape)
        return whole if dst == src else whole.to(dst)
    if out is None:
        device = as_tensor(runs[0]).device if runs else torch.device("cpu")
        out = torch.empty(shape, dtype=dst, device=device)
    flat = out.view(-1)
    if any(nbytes_of(run) % itemsize for run in runs):
        # A run that splits an element (no tier does that: pages are multiples of 4 bytes):
        # gather the bytes first, convert after.
        staging = torch.empty(total, dtype=torch.uint8, device=flat.device)
        copy_runs(staging, runs)
        flat.copy_(staging.view(src))
        return out
    if dst == src:
        copy_runs(flat.view(torch.uint8), runs)
    else:
        offset = 0
        for run in runs:
            n = nbytes_of(run) // itemsize
            flat[offset : offset + n].copy_(as_tensor(run).view(src))
            offset += n
    return out


def convert_tensor(
    tensor: torch.Tensor, requested: Any, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``tensor`` (bf16 / fp16 / fp32) in the ``requested`` dtype: itself when it already is
    (and no ``out`` is given), else a converted copy (into ``out`` when given)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    convertible(tensor.dtype)
    dst = convertible(requested)
    if out is None:
        return tensor if tensor.dtype == dst else tensor.to(dst)
    check_out(out, tuple(tensor.shape), dst)
    out.copy_(tensor)
    return out


def layer_shape(layout: ChunkLayout, heads: HeadRange | None = None) -> tuple[int, int, int, int]:
    """``[planes, heads, tokens, head_dim]`` of a layer (or of heads ``[a, b)`` of it)."""
    spec = layout.spec
    count = spec.num_kv_heads if heads is None else heads[1] - heads[0]
    return (spec.kv_planes, count, layout.num_tokens, spec.head_dim)


def read_layer(
    reader: PayloadReader,
    layer: int,
    *,
    heads: HeadRange | None = None,
    dtype: Any = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One committed layer (or heads ``[a, b)`` of it) as ``[planes, heads, tokens, head_dim]``
    in ``dtype`` (default: the stored dtype); a view of the reader's pages when that needs no
    copy (valid while the object stays pinned), else a copy (into ``out`` when given).
    A float8 object is dequantized (``dtype`` required)."""
    pieces = reader.layer_pieces(layer, heads)
    shape = layer_shape(reader.layout, heads)
    if _quantized(reader.layout, dtype):
        return fp8.read_pieces(pieces, shape, dtype, out=out)
    return convert_pieces(pieces, reader.layout.spec.dtype, dtype, shape, out=out)


def write_layer(
    writer: PayloadWriter, layer: int, data: torch.Tensor, *, heads: HeadRange | None = None
) -> None:
    """Canonical ``data`` ``[planes, heads, tokens, head_dim]`` (bf16 / fp16 / fp32) into a
    writer's layer (or heads ``[a, b)`` of it; a head-range writer's own range by default),
    converted to the stored dtype: a plain copy when it already is, quantized for a float8
    object."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(data).__name__}")
    pieces = writer.layer_pieces(layer, heads)
    own = heads if heads is not None else writer.heads
    shape = layer_shape(writer.layout, own)
    if tuple(data.shape) != shape:
        raise PayloadSizeError(f"layer {layer} is {list(shape)}, got {list(data.shape)}")
    convertible(data.dtype)
    if writer.layout.spec.dtype is KVDtype.FLOAT8_E4M3:
        fp8.write_pieces(pieces, data)
        return
    converted = convert_tensor(data, writer.layout.spec.dtype).contiguous()
    copy_pieces(pieces, [converted.view(-1).view(torch.uint8)])


def layer_in_place(writer: PayloadWriter, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The writer's layer (its own heads) as a ``[planes, heads, tokens, head_dim]`` tensor of
    ``dtype`` that aliases its pages, or None where data of ``dtype`` cannot land there as is
    (another stored dtype, float8, or pages that are not one contiguous run): then
    :func:`write_layer`. Fill it completely before committing the layer."""
    spec = writer.layout.spec
    if spec.dtype is KVDtype.FLOAT8_E4M3 or convertible(spec.dtype) != dtype:
        return None
    runs = coalesce(writer.layer_pieces(layer))
    if len(runs) != 1:
        return None
    return as_tensor(runs[0]).view(dtype).view(layer_shape(writer.layout, writer.heads))


def read_payload(
    reader: PayloadReader,
    *,
    heads: HeadRange | None = None,
    dtype: Any = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A complete object (or heads ``[a, b)`` of every layer: one tensor-parallel rank's
    share) as ``[layers, planes, heads, tokens, head_dim]`` in ``dtype``.

    Without ``heads``, like :func:`read_layer` (a view when nothing changes). With ``heads``,
    a copy (into ``out`` when given): host pages in the stored dtype move with one flat copy
    per (layer, plane) run, straight from the pages (the fast path of a tensor-parallel
    reader); otherwise converted from one strided view, or layer by layer."""
    layout = reader.layout
    spec = layout.spec
    if _quantized(layout, dtype):
        return _read_quantized_payload(reader, heads, dtype, out)
    if heads is None:
        shape = (spec.num_layers, *layer_shape(layout))
        return convert_pieces(reader.pieces(), spec.dtype, dtype, shape, out=out)
    layout.head_ranges(0, *heads)  # validates the range
    src = convertible(spec.dtype)
    dst = src if dtype is None else convertible(dtype)
    shape = (spec.num_layers, *layer_shape(layout, heads))
    pieces = reader.pieces()  # views of every page: built once, they are not free
    if out is None:
        out = torch.empty(shape, dtype=dst, device=as_tensor(pieces[0]).device)
    else:
        check_out(out, shape, dst)
    # one object's pages all live in one tier: host (numpy) or device (torch) alike
    if dst == src and out.device.type == "cpu" and isinstance(pieces[0], np.ndarray):
        _copy_head_runs(pieces, layout, heads, out.view(-1).view(torch.uint8).numpy())
        return out
    runs = coalesce(pieces)
    if len(runs) == 1:
        whole = as_tensor(runs[0]).view(src).view(spec.num_layers, *layer_shape(layout))
        out.copy_(whole[:, :, heads[0] : heads[1]])  # converts on the way
        return out
    for layer in range(spec.num_layers):
        convert_pieces(reader.layer_pieces(layer, heads), src, dst, shape[1:], out=out[layer])
    return out


def _read_quantized_payload(
    reader: PayloadReader, heads: HeadRange | None, dtype: Any, out: torch.Tensor | None
) -> torch.Tensor:
    """A float8 object (or a head range of it) dequantized layer by layer into one tensor."""
    layout = reader.layout
    if heads is not None:
        layout.head_ranges(0, *heads)  # validates the range
    shape = (layout.spec.num_layers, *layer_shape(layout, heads))
    target = convertible(dtype)
    pieces = reader.pieces()  # also: the object must be complete
    if out is None:
        device = as_tensor(pieces[0]).device if pieces else torch.device("cpu")
        out = torch.empty(shape, dtype=target, device=device)
    else:
        check_out(out, shape, target)
    for layer in range(layout.spec.num_layers):
        fp8.read_pieces(reader.layer_pieces(layer, heads), shape[1:], target, out=out[layer])
    return out


def _quantized(layout: ChunkLayout, dtype: Any) -> bool:
    """Whether reads of ``layout`` dequantize; a float8 read must name its dtype."""
    if layout.spec.dtype is not KVDtype.FLOAT8_E4M3:
        return False
    if dtype is None:
        raise SpecError(
            "a float8_e4m3fn object is read dequantized: pass dtype= (bfloat16, float16 or float32)"
        )
    return True


def _copy_head_runs(
    pieces: Sequence[np.ndarray], layout: ChunkLayout, heads: HeadRange, into: np.ndarray
) -> None:
    """Copy heads ``[a, b)`` of every (layer, plane) of a payload held in host ``pieces``
    into flat ``into``: one run per (layer, plane), all in one :func:`gather_runs` call."""
    spec = layout.spec
    gather_runs(
        into,
        pieces,
        heads[0] * layout.head_bytes,
        (spec.num_layers, layout.layer_bytes),
        (spec.kv_planes, layout.plane_bytes),
        (heads[1] - heads[0]) * layout.head_bytes,
    )
