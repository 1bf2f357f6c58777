"""How the SSD tier keeps an object's payload: as is, or quantized to fp8.

With an SSD tier's ``format: fp8``, a bf16 / fp16 / fp32 chunk goes to disk in
:mod:`kvfabric.convert.fp8`'s serialized form, layer by layer (e4m3 values with a float32
scale per (layer, k|v, head)): about half the bytes of bf16, within the error bound that
module documents, and decoded back to the namespace's dtype when the chunk is read back into
memory. Readers of such a namespace never see fp8: memory tiers always hold the namespace's
dtype. A chunk of any other dtype stays native; in particular a namespace stored in fp8 at
put time (KVSpec dtype ``float8_e4m3fn``) already is in that very serialized form, and goes
to disk byte for byte. The record's metadata (:func:`encode_meta`) says which form it is in,
so a restart decodes correctly whatever the tier's format is by then.

Pure functions over page pieces and records' metadata; torch is imported only when fp8 is
in use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np

from kvfabric.hashing import KEY_BYTES
from kvfabric.memory.copy import Piece, copy_pieces
from kvfabric.spec import KVSpec, Namespace
from kvfabric.tiers.disk.records import MAX_META

if TYPE_CHECKING:
    from kvfabric.store.index import Entry

NATIVE = "native"
FP8 = "fp8"
FORMATS = (NATIVE, FP8)


def encodable(spec: KVSpec) -> bool:
    return spec.dtype.is_float


def encoded_nbytes(spec: KVSpec, num_tokens: int) -> int:
    from kvfabric.convert import fp8

    return fp8.chunk_nbytes(spec, num_tokens)


def encode(spec: KVSpec, num_tokens: int, pieces: list[Piece]) -> np.ndarray:
    """The chunk held in ``pieces`` (native canonical payload) in fp8 serialized form."""
    from kvfabric.convert import fp8

    native = np.empty(spec.layout(num_tokens).nbytes, dtype=np.uint8)
    copy_pieces([native], pieces)
    out = np.empty(encoded_nbytes(spec, num_tokens), dtype=np.uint8)
    for src, dst in _layer_slices(spec, num_tokens):
        fp8.encode_layer(_layer_tensor(spec, num_tokens, native[src]), out=out[dst])
    return out


def decode_into(spec: KVSpec, num_tokens: int, raw: np.ndarray, pieces: list[Piece]) -> None:
    """Decode an fp8 serialized chunk into ``pieces`` (the native payload's pages)."""
    from kvfabric.convert import fp8

    native = np.empty(spec.layout(num_tokens).nbytes, dtype=np.uint8)
    for src, dst in _layer_slices(spec, num_tokens):
        target = _layer_tensor(spec, num_tokens, native[src])
        fp8.decode_layer(raw[dst], tuple(target.shape), target.dtype, out=target)
    copy_pieces(pieces, [native])


def _layer_slices(spec: KVSpec, num_tokens: int) -> list[tuple[slice, slice]]:
    """Per layer: (its bytes in the native payload, its bytes in the fp8 form)."""
    from kvfabric.convert import fp8

    layout = spec.layout(num_tokens)
    encoded = fp8.serialized_nbytes(_shape(spec, num_tokens))
    return [
        (
            slice(layer * layout.layer_bytes, (layer + 1) * layout.layer_bytes),
            slice(layer * encoded, (layer + 1) * encoded),
        )
        for layer in range(spec.num_layers)
    ]


def _shape(spec: KVSpec, num_tokens: int) -> tuple[int, int, int, int]:
    return (spec.kv_planes, spec.num_kv_heads, num_tokens, spec.head_dim)


def _layer_tensor(spec: KVSpec, num_tokens: int, raw: np.ndarray) -> Any:
    import torch

    return (
        torch.from_numpy(raw).view(getattr(torch, spec.dtype.value)).view(_shape(spec, num_tokens))
    )


def encode_meta(entry: Entry, fmt: str = NATIVE) -> bytes:
    """The SSD record's metadata: enough to re-index (and decode) the object after a
    restart. ``fmt`` appears only for fp8 records: native ones read as they always did.
    ``tk``, the chunk's token ids, appears only when the entry has them and they fit in a
    record's metadata (:data:`~kvfabric.tiers.disk.records.MAX_META`: about 700 tokens with
    the rest): a longer chunk's record is recovered without them."""
    ns = entry.ns
    meta = {
        "v": 1,
        "parent": entry.parent,
        "tokens": entry.num_tokens,
        "model": ns.model_id,
        "tenant": ns.tenant_salt,
        "lora": ns.lora_id,
        "spec": ns.spec.to_dict(),
    }
    if fmt != NATIVE:
        meta["fmt"] = fmt
    packed: bytes = msgpack.packb(meta)
    if entry.tokens is not None:
        meta["tk"] = entry.tokens
        with_tokens: bytes = msgpack.packb(meta)
        if len(with_tokens) <= MAX_META:
            return with_tokens
    return packed


class RecordMeta(NamedTuple):
    """What an SSD record's metadata says of its object (:func:`decode_meta`)."""

    ns: Namespace
    parent: bytes
    num_tokens: int
    fmt: str
    tokens: bytes | None  # None: written without them (or by a version that kept none)


def decode_meta(raw: bytes) -> RecordMeta:
    meta = msgpack.unpackb(raw)
    if not isinstance(meta, dict) or meta.get("v") != 1:
        raise ValueError("unknown metadata version")
    spec = KVSpec.from_dict(meta["spec"])
    ns = Namespace(meta["model"], spec, meta["tenant"], meta["lora"])
    parent = meta["parent"]
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ValueError("bad parent key")
    spec.layout(meta["tokens"])
    fmt = meta.get("fmt", NATIVE)
    if fmt not in FORMATS:
        raise ValueError(f"unknown payload format {fmt!r}")
    num_tokens = int(meta["tokens"])
    tokens = meta.get("tk")
    if tokens is not None and (not isinstance(tokens, bytes) or len(tokens) != num_tokens * 4):
        raise ValueError("bad token ids")
    return RecordMeta(ns, parent, num_tokens, fmt, tokens)
