"""An fp8 storage format for canonical KV: float8 e4m3 values with per-head float32 scales.

A layer of canonical KV ``[planes, heads, tokens, head_dim]`` (planes = K and V, or the MLA
latent) in bfloat16, float16 or float32 is stored as

* ``data``: ``torch.float8_e4m3fn`` ``[planes, heads, tokens, head_dim]``, one byte an element;
* ``scales``: ``float32`` ``[planes, heads]``, one per (layer, k|v, head), with
  ``x ~= float(data) * scale``.

``scale = amax / 448`` over the (plane, head)'s elements (448 is e4m3's largest finite value),
so the largest magnitude lands on 448 and the head uses e4m3's whole range. Guards: a head of
zeros gets ``scale = 1`` (any scale represents it exactly), and a scale never goes below
``2**-126`` (the smallest normal float32) so that its reciprocal stays finite; a head whose
``amax / 448`` is smaller than that only widens the absolute term of the bound below.
Non-finite inputs (inf, NaN) are rejected: e4m3fn has no infinity.

Serialized form of one layer (:func:`pack` / :func:`unpack`, :func:`encode_layer` /
:func:`decode_layer`), ``serialized_nbytes(shape) = planes * heads * (4 + tokens * head_dim)``
bytes, no header (the spec and token count give the shape): one record per (plane, head), in
``[plane][head]`` order, each ::

    [scale: float32 little-endian][values: tokens * head_dim e4m3 bytes, [token][head_dim]]

This is also the payload of a namespace whose :class:`~kvfabric.spec.KVSpec` dtype is
``float8_e4m3fn`` (its :class:`~kvfabric.spec.ChunkLayout` counts a head as ``4 + tokens *
head_dim`` bytes), and of a chunk an SSD tier keeps in fp8: a chunk is its layers' serialized
forms back to back (:func:`chunk_nbytes`). Scale next to values keeps the canonical layout's
property: heads ``[a, b)`` of a layer are one contiguous run per plane, scales included, and
those runs back to back are the serialized form of the ``[planes, b - a, tokens, head_dim]``
sub-layer, so a tensor-parallel rank reads (and writes) only its heads' values and scales.

Stored objects are read and written through page pieces with :func:`read_pieces` /
:func:`write_pieces`; :func:`kvfabric.convert.read_layer` / ``read_payload`` /
``write_layer`` call them for a float8 namespace, so producers hand over bf16 / fp16 / fp32
tensors (quantized on the way in) and consumers get them back in their own dtype.

Error bound (per element; derivation)
-------------------------------------
Let ``s`` be the element's scale and ``y = x / s``. Quantization computes
``y' = fl32(x * fl32(1 / s)) = y * (1 + e)`` with ``|e| <= 2**-23`` (two float32 roundings),
``|y'| <= 448 * (1 + 2**-23)``, and rounds it to e4m3 (round to nearest even, saturating at
448), giving ``q``. e4m3 has 3 mantissa bits:

* normal range (``|y'| >= 2**-6``): within ``[2**k, 2**(k+1))`` consecutive values are
  ``2**(k-3)`` apart, so ``|q - y'| <= 2**(k-4) <= |y'| * 2**-4`` (relative half-ULP ``2**-4``;
  the worst case, just above a power of two, is ``|y'| / 17``);
* subnormal range (``|y'| < 2**-6``): values are multiples of ``2**-9`` (the subnormal step,
  in units of the scale), so ``|q - y'| <= 2**-10``.

Dequantization returns ``d = fl32(q * s)``. Adding up (the gap between ``1/17`` and ``1/16``
absorbs the float32 roundings)::

    |x - dequantize(quantize(x))| <= |x| * 2**-4 + scale * 2**-10          (float32 output)

Dequantizing to a narrower dtype rounds ``d`` once more, by at most ``u * |d|`` with ``u`` its
unit roundoff (``2**-8`` bfloat16, ``2**-11`` float16), so then the bound is
``(|x| * 2**-4 + scale * 2**-10) * (1 + u) + |x| * u``, plus half the dtype's subnormal step
for results below its normal range (``2**-134`` bfloat16, ``2**-25`` float16); values beyond
the output dtype's range (float16's 65504, float32 values past bfloat16's largest) become inf
there, as any conversion makes them. :func:`error_bound` computes the bound.

Throughput on one CPU core: quantizing is bound by torch's float32 -> e4m3 cast; dequantizing
does not use torch's e4m3 -> float cast (a slow scalar loop on CPU) but builds the output
dtype's bit pattern from the e4m3 bits with integer ops (the e4m3 value times a power of two,
subnormals included) and multiplies by ``scale`` times that power of two: bit-identical to
``(data.float() * scale).to(dtype)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvfabric.convert.pieces import as_tensor, coalesce, convertible, copy_runs
from kvfabric.errors import PayloadSizeError, SpecError
from kvfabric.memory.copy import Piece, copy_pieces, nbytes_of
from kvfabric.spec import KVDtype, KVSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE = 2.0**-126  # smallest normal float32: keeps 1 / scale finite
SCALE_BYTES = KVDtype.FLOAT8_E4M3.scale_bytes  # float32, in front of each head's values

# Unit roundoff of each output dtype (half an ULP relative to the value).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# Half the spacing of each narrow output dtype's subnormals (its rounding error down there).
_HALF_SUBNORMAL_STEP = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}

# Per output dtype: (integer dtype of its bits, mantissa bits - 3, 2 ** (exponent bias - 7)).
# e4m3 bits s.eeee.mmm moved to (s, exponent field, top mantissa bits) of the output format
# read as that format's value = the e4m3 value * 2 ** (7 - bias), subnormals included.
_BITS = {
    torch.bfloat16: (torch.int16, 4, 2.0**120),
    torch.float16: (torch.int16, 7, 2.0**8),
    torch.float32: (torch.int32, 20, 2.0**120),
}
_F32_MAX = float(np.finfo(np.float32).max)


class QuantizedLayer(NamedTuple):
    """One layer in fp8: ``data`` e4m3 ``[planes, heads, tokens, head_dim]``, ``scales``
    float32 ``[planes, heads]``."""

    data: torch.Tensor
    scales: torch.Tensor


def serialized_nbytes(shape: Any) -> int:
    """Bytes of one layer's serialized fp8 form; ``shape`` = ``[planes, heads, tokens, dim]``."""
    planes, heads, tokens, dim = _shape(shape)
    return planes * heads * (SCALE_BYTES + tokens * dim)


def chunk_nbytes(spec: KVSpec, num_tokens: int | None = None) -> int:
    """Bytes of a whole chunk in fp8 (every layer's serialized form): the payload size of
    ``spec`` with its dtype made float8."""
    return dataclasses.replace(spec, dtype=KVDtype.FLOAT8_E4M3).layout(num_tokens).nbytes


def bytes_saved(spec: KVSpec, num_tokens: int | None = None, *, baseline: Any = "bfloat16") -> int:
    """Bytes a chunk saves in fp8 (scales included) against ``baseline`` (default bfloat16):
    ``baseline bytes - fp8 bytes``, a gauge-friendly integer (negative only for absurdly short
    heads, where the scales outweigh the halving)."""
    itemsize = convertible(baseline).itemsize
    layout = spec.layout(num_tokens)
    elements = (
        spec.num_layers * spec.kv_planes * spec.num_kv_heads * layout.num_tokens * spec.head_dim
    )
    return elements * itemsize - chunk_nbytes(spec, num_tokens)


def compute_scales(layer: torch.Tensor) -> torch.Tensor:
    """float32 ``[planes, heads]`` scales of canonical ``layer``: ``amax / 448``, guarded."""
    _check_layer(layer)
    planes, heads = layer.shape[:2]
    flat = layer.reshape(planes * heads, -1)
    if flat.shape[1] == 0:
        return torch.ones(planes, heads, dtype=torch.float32, device=layer.device)
    # two reductions, no |x| temporary
    amax = torch.maximum(flat.amax(dim=1), flat.amin(dim=1).neg()).to(torch.float64)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize non-finite KV (inf or NaN) to e4m3, which has no inf")
    scales = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    scales[amax == 0] = 1.0
    return scales.to(torch.float32).view(planes, heads)


def quantize(layer: torch.Tensor, *, out: QuantizedLayer | None = None) -> QuantizedLayer:
    """Canonical ``layer`` (bf16 / fp16 / fp32 ``[planes, heads, tokens, head_dim]``) to fp8.

    ``out``, when given, receives the result (``data`` e4m3 and ``scales`` float32 of the
    right shapes, contiguous). :func:`encode_layer` quantizes into a serialized buffer."""
    scales = compute_scales(layer)
    if out is None:
        out = QuantizedLayer(torch.empty(layer.shape, dtype=FP8, device=layer.device), scales)
    else:
        _check_quantized(out, tuple(layer.shape))
        out.scales.copy_(scales)
    _scale_into(layer, scales, out.data)
    return out


def _scale_into(layer: torch.Tensor, scales: torch.Tensor, data: torch.Tensor) -> None:
    """``data`` (e4m3, any strides) = ``layer / scales``, rounded to nearest even."""
    inverse = (1.0 / scales.to(torch.float64)).to(torch.float32)  # <= 2**126: finite
    # x * (1 / s) computed in float32 whatever the input dtype, cast (saturating) to e4m3
    # on the way out: one pass over the input, no float32 temporary of the whole layer.
    torch.mul(layer, inverse[:, :, None, None], out=data)


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    dtype: Any = torch.bfloat16,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8 ``data`` ``[planes, heads, tokens, dim]`` with ``scales`` ``[planes, heads]`` back
    to ``dtype`` (bf16, fp16 or fp32); into ``out`` when given. Bit-identical to
    ``(data.float() * scales[..., None, None]).to(dtype)``."""
    target = convertible(dtype)
    if not isinstance(data, torch.Tensor) or data.dtype not in (FP8, torch.uint8, torch.int8):
        raise SpecError(
            f"data must be a float8_e4m3fn (or raw uint8) tensor, got "
            f"{getattr(data, 'dtype', type(data).__name__)}"
        )
    planes, heads = _shape(data.shape)[:2]
    if tuple(scales.shape) != (planes, heads):
        raise PayloadSizeError(f"scales must be [{planes}, {heads}], got {list(scales.shape)}")
    if out is None:
        out = torch.empty(data.shape, dtype=target, device=data.device)
    elif out.dtype != target or out.shape != data.shape or not out.is_contiguous():
        raise PayloadSizeError(
            f"out must be a contiguous {target} tensor of shape "
            f"{list(data.shape)}, got {out.dtype} {list(out.shape)}"
        )
    if out.numel() == 0:
        return out
    int_type, shift, power = _BITS[target]
    bits = out.view(int_type)
    bits.copy_(data.view(torch.int8))  # sign-extends: the sign bit fills the high bits
    magnitude = torch.bitwise_and(bits, 0x7F)
    magnitude.bitwise_left_shift_(shift)  # exponent and mantissa into place
    bits.bitwise_and_(torch.iinfo(int_type).min)  # the sign bit alone
    bits.bitwise_or_(magnitude)  # out now holds each e4m3 value * 2 ** (7 - bias)
    factors = scales.to(torch.float64).cpu().mul(power).tolist()
    for plane in range(planes):
        for head in range(heads):
            factor, view = factors[plane][head], out[plane, head]
            if factor <= _F32_MAX:
                view.mul_(factor)  # one rounding: power and scale are both exact in float32
            else:  # scale >= 2**8: the power first (exact), then the scale
                view.mul_(power).mul_(float(scales[plane, head]))
    return out


def pack(layer: QuantizedLayer, out: Any = None) -> torch.Tensor:
    """The serialized form of a quantized layer, as a flat uint8 tensor (``out``, a flat
    uint8 buffer of :func:`serialized_nbytes` bytes, when given)."""
    shape = _shape(layer.data.shape)
    _check_quantized(layer, shape)
    raw = (
        torch.empty(serialized_nbytes(shape), dtype=torch.uint8)
        if out is None
        else _byte_tensor(out)
    )
    scale_bytes, data = _records(raw, shape)
    scale_bytes.copy_(_scale_bytes(layer.scales))
    data.copy_(layer.data)
    return raw


def unpack(buffer: Any, shape: Any) -> QuantizedLayer:
    """``data`` (a zero-copy, strided view) and ``scales`` (a copy: 4 bytes a head, not
    necessarily 4-byte aligned) of a serialized layer of ``shape`` (``buffer``: a flat uint8
    tensor, numpy array or bytes-like of exactly that size)."""
    planes, heads = _shape(shape)[:2]
    scale_bytes, data = _records(_byte_tensor(buffer), shape)
    scales = scale_bytes.contiguous().view(torch.float32).view(planes, heads)
    return QuantizedLayer(data, scales)


def encode_layer(layer: torch.Tensor, out: Any = None) -> torch.Tensor:
    """Quantize ``layer`` straight into its serialized form (into ``out`` when given: e.g.
    the views of a store writer's layer); returns the flat uint8 tensor."""
    shape = _shape(layer.shape)
    raw = (
        torch.empty(serialized_nbytes(shape), dtype=torch.uint8, device=layer.device)
        if out is None
        else _byte_tensor(out)
    )
    scale_bytes, data = _records(raw, shape)
    scales = compute_scales(layer)
    scale_bytes.copy_(_scale_bytes(scales))
    _scale_into(layer, scales, data)
    return raw


def decode_layer(
    buffer: Any, shape: Any, dtype: Any = torch.bfloat16, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A serialized layer of ``shape`` back to ``dtype`` (see :func:`dequantize`)."""
    layer = unpack(buffer, shape)
    return dequantize(layer.data, layer.scales, dtype, out=out)


def read_pieces(
    pieces: Sequence[Piece], shape: Any, dtype: Any, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The serialized layer (or head range of one) held in ``pieces`` (a reader's zero-copy
    views) dequantized to ``dtype`` as a ``shape`` tensor (into ``out`` when given).

    Reads straight from the pieces when they are one run of memory, else gathers them first
    (one copy of the fp8 bytes, half the size of the output in bf16)."""
    convertible(dtype)
    shape = _shape(shape)
    total = sum(nbytes_of(piece) for piece in pieces)
    if total != serialized_nbytes(shape):
        raise PayloadSizeError(
            f"{total} bytes of fp8 records do not hold a layer of shape "
            f"{list(shape)} ({serialized_nbytes(shape)} bytes)"
        )
    runs = coalesce(pieces)
    if len(runs) == 1:
        raw = as_tensor(runs[0]).reshape(-1)
    else:
        device = as_tensor(runs[0]).device if runs else torch.device("cpu")
        raw = torch.empty(total, dtype=torch.uint8, device=device)
        copy_runs(raw, runs)
    return decode_layer(raw, shape, dtype, out=out)


def write_pieces(pieces: Sequence[Piece], layer: torch.Tensor) -> None:
    """Quantize canonical ``layer`` (bf16 / fp16 / fp32) into ``pieces`` (a writer's views
    of a layer or head range of a float8 object), straight into them when they are one run
    of memory, else through one fp8 buffer."""
    shape = _shape(layer.shape)
    total = sum(nbytes_of(piece) for piece in pieces)
    if total != serialized_nbytes(shape):
        raise PayloadSizeError(
            f"a layer of shape {list(shape)} is {serialized_nbytes(shape)} "
            f"bytes in fp8, the destination holds {total}"
        )
    runs = coalesce(pieces)
    if len(runs) == 1 and as_tensor(runs[0]).device == layer.device:
        encode_layer(layer, out=_byte_tensor(runs[0]))
        return
    raw = encode_layer(layer)
    copy_pieces(list(pieces), [raw.numpy() if raw.device.type == "cpu" else raw])


def error_bound(x: torch.Tensor, scales: torch.Tensor, dtype: Any = torch.float32) -> torch.Tensor:
    """The per-element bound on ``|x - dequantize(quantize(x), dtype)|`` (float64), as stated
    in the module docstring: ``|x| * 2**-4 + scale * 2**-10`` for float32 output, widened by
    the output dtype's own rounding otherwise (subnormal results included)."""
    target = convertible(dtype)
    magnitude = x.to(torch.float64).abs()
    bound = magnitude * 2.0**-4 + scales.to(torch.float64)[:, :, None, None] * 2.0**-10
    if target != torch.float32:
        u = UNIT_ROUNDOFF[target]
        bound = bound * (1 + u) + magnitude * u
        bound = bound + _HALF_SUBNORMAL_STEP[target]
    return bound


def _byte_tensor(buffer: Any) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("a serialized fp8 layer must be a flat contiguous uint8 tensor")
        return buffer
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("a serialized fp8 layer must be C-contiguous")
        return as_tensor(buffer.reshape(-1).view(np.uint8))
    return as_tensor(np.frombuffer(buffer, dtype=np.uint8))


def _records(raw: torch.Tensor, shape: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a serialized layer: each record's scale bytes ``[planes, heads, 4]`` (uint8)
    and its values ``[planes, heads, tokens, head_dim]`` (e4m3)."""
    planes, heads, tokens, dim = _shape(shape)
    expected = serialized_nbytes((planes, heads, tokens, dim))
    if raw.numel() != expected:
        raise PayloadSizeError(
            f"a serialized fp8 layer of shape {[planes, heads, tokens, dim]} "
            f"is {expected} bytes, got {raw.numel()}"
        )
    records = raw.view(planes, heads, SCALE_BYTES + tokens * dim)
    values = records[:, :, SCALE_BYTES:].view(FP8).unflatten(2, (tokens, dim))  # type: ignore[no-untyped-call]  # a view, never a copy: reshape could copy
    return records[:, :, :SCALE_BYTES], values


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[planes, heads]`` scales as their bytes ``[planes, heads, 4]`` (native
    order: little-endian on every host torch supports)."""
    return scales.to(torch.float32).contiguous().view(torch.uint8).view(*scales.shape, SCALE_BYTES)


def _shape(shape: Any) -> tuple[int, int, int, int]:
    dims = tuple(int(n) for n in shape)
    if len(dims) != 4 or any(n < 0 for n in dims):
        raise PayloadSizeError(
            f"a canonical layer is [planes, heads, tokens, head_dim], got {list(dims)}"
        )
    return dims[0], dims[1], dims[2], dims[3]


def _check_layer(layer: torch.Tensor) -> None:
    if not isinstance(layer, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(layer).__name__}")
    convertible(layer.dtype)
    _shape(layer.shape)


def _check_quantized(layer: QuantizedLayer, shape: tuple[int, ...]) -> None:
    data, scales = layer
    if data.dtype != FP8 or tuple(data.shape) != shape:
        raise PayloadSizeError(
            f"data must be a float8_e4m3fn tensor of shape "
            f"{list(shape)}, got {data.dtype} {list(data.shape)}"
        )
    if scales.dtype != torch.float32 or tuple(scales.shape) != shape[:2]:
        raise PayloadSizeError(
            f"scales must be float32 {list(shape[:2])}, got {scales.dtype} {list(scales.shape)}"
        )


__all__ = [
    "FP8",
    "FP8_MAX",
    "MIN_SCALE",
    "QuantizedLayer",
    "bytes_saved",
    "chunk_nbytes",
    "compute_scales",
    "decode_layer",
    "dequantize",
    "encode_layer",
    "error_bound",
    "pack",
    "quantize",
    "read_pieces",
    "serialized_nbytes",
    "unpack",
    "write_pieces",
]
