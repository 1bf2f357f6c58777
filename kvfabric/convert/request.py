"""Reading a pinned chunk the way a :class:`~kvfabric.readspec.ReadSpec` asks, on the consumer.

:func:`read_layer_as` and :func:`read_as` take a reader (a client's ``RemoteReader`` or the
store's in-process handle) and the consumer's spec (by default the one the reader was
requested with: ``reader.want``) and return the layer / the payload in the wanted dtype,
KV-head range and layout. When the spec changes nothing the result is a zero-copy view of
the pinned pages (valid only while the reader stays pinned); otherwise one converting copy
per layer, straight from the pages, into ``out`` when given (a token-major read converts
while it transposes; a head-range one gathers its heads first). Errors as in
:mod:`kvfabric.convert.dtype`; a spec the object's namespace cannot serve is a SpecError.
"""

from __future__ import annotations

import torch

from kvfabric.convert.dtype import read_layer, read_payload
from kvfabric.convert.pieces import torch_dtype
from kvfabric.payload import PayloadReader
from kvfabric.readspec import KVLayout, ReadSpec
from kvfabric.spec import KVDtype


def read_layer_as(
    reader: PayloadReader,
    layer: int,
    want: ReadSpec | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One committed layer as ``want`` says: ``[planes, heads, tokens, head_dim]`` (hnd) or
    ``[planes, tokens, heads, head_dim]`` (nhd)."""
    want = _wanted(reader, want)
    if want.layout is KVLayout.HND:
        return read_layer(reader, layer, heads=want.heads, dtype=want.dtype, out=out)
    hnd = read_layer(reader, layer, heads=want.heads, dtype=_first_pass(reader, want))
    return _to_nhd(hnd, out, dim=1, dtype=want.dtype)


def read_as(
    reader: PayloadReader, want: ReadSpec | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A complete object as ``want`` says, with a leading layer dimension."""
    want = _wanted(reader, want)
    if want.layout is KVLayout.HND:
        return read_payload(reader, heads=want.heads, dtype=want.dtype, out=out)
    hnd = read_payload(reader, heads=want.heads, dtype=_first_pass(reader, want))
    return _to_nhd(hnd, out, dim=2, dtype=want.dtype)


def _wanted(reader: PayloadReader, want: ReadSpec | None) -> ReadSpec:
    if want is None:
        want = getattr(reader, "want", None) or ReadSpec()
    if not isinstance(want, ReadSpec):
        raise TypeError(f"want must be a ReadSpec, got {type(want).__name__}")
    want.check(reader.layout.spec)
    return want


def _first_pass(reader: PayloadReader, want: ReadSpec) -> KVDtype | None:
    """The dtype to read in before transposing: as stored (a view where the pages allow),
    so the transposing copy also converts; float8 only comes out dequantized."""
    return want.dtype if reader.layout.spec.dtype is KVDtype.FLOAT8_E4M3 else None


def _to_nhd(
    hnd: torch.Tensor, out: torch.Tensor | None, dim: int, dtype: KVDtype | None
) -> torch.Tensor:
    """Swap the heads axis ``dim`` with the tokens axis after it, converting to ``dtype`` on
    the way (one strided copy)."""
    swapped = hnd.transpose(dim, dim + 1)
    target = hnd.dtype if dtype is None else torch_dtype(dtype)
    if out is None:
        out = torch.empty(swapped.shape, dtype=target, device=swapped.device)
    elif tuple(out.shape) != tuple(swapped.shape) or out.dtype != target:
        raise ValueError(
            f"out must be {list(swapped.shape)} {target}, got {list(out.shape)} {out.dtype}"
        )
    out.copy_(swapped)
    return out


def wanted_shape(reader: PayloadReader, want: ReadSpec | None = None) -> tuple[int, ...]:
    """The shape :func:`read_layer_as` returns (to preallocate ``out``)."""
    want = _wanted(reader, want)
    spec = reader.layout.spec
    start, end = want.heads or (0, spec.num_kv_heads)
    heads, tokens = end - start, reader.layout.num_tokens
    if want.layout is KVLayout.NHD:
        return (spec.kv_planes, tokens, heads, spec.head_dim)
    return (spec.kv_planes, heads, tokens, spec.head_dim)
