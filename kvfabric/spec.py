"""The KV data model: what a chunk of KV cache is, and which namespace it belongs to.

* :class:`KVSpec` describes the shape of the KV cache a model produces (layers, KV heads,
  head size, dtype, attention kind) and how many tokens make one chunk. Its
  :attr:`~KVSpec.fingerprint` is stable across processes and machines and is part of every key.
* :class:`Namespace` is (model id, spec fingerprint, tenant salt, LoRA id). Two namespaces
  never share a chunk: the namespace seed is mixed into every chunk hash.
* :class:`ChunkLayout` maps the canonical payload layout
  ``[layer][k|v][kv_head][token][head_dim]`` to byte ranges. Head-major inside a layer makes
  every tensor-parallel head range one contiguous run per (layer, k|v). A float8 (e4m3)
  payload stores each (layer, k|v, head) as its float32 scale followed by its values
  (``[layer][k|v][kv_head]{scale, [token][head_dim]}``, see :mod:`kvfabric.convert.fp8`), so a
  head range still is one run per (layer, k|v) and carries its own scales.

Everything here is a frozen value; validation raises :class:`~kvfabric.errors.SpecError`.
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import xxhash

from kvfabric.errors import SpecError

DEFAULT_CHUNK_TOKENS = 256


class AttentionKind(str, enum.Enum):
    """MHA/GQA keep separate K and V per KV head; MLA keeps one latent vector per token."""

    MHA = "mha"  # also GQA/MQA: num_kv_heads <= num_attention_heads
    MLA = "mla"


class KVDtype(str, enum.Enum):
    """Storage dtypes of canonical payloads (names follow torch)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FLOAT8_E4M3 = "float8_e4m3fn"
    # opaque bytes: payloads kvfabric moves but never interprets (an LMCache chunk in its
    # own format); no conversion reads them as anything else
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        """bfloat16, float16, float32: converted element by element into each other."""
        return self in _FLOATS

    def reads_as(self, wanted: KVDtype) -> bool:
        """Whether a payload stored in this dtype can be read as ``wanted``: as itself, or
        as any float dtype from a float payload or a float8 one (dequantized)."""
        return wanted is self or (
            wanted.is_float and (self.is_float or self is KVDtype.FLOAT8_E4M3)
        )

    @property
    def scale_bytes(self) -> int:
        """Bytes of the per-(layer, k|v, head) scale stored in front of each head's values:
        4 (float32) for float8, 0 for the dtypes that need none."""
        return _SCALE_BYTES.get(self, 0)

    @property
    def code(self) -> int:
        """Small stable integer used in binary encodings (fingerprints, disk records)."""
        return _CODES[self]

    @classmethod
    def parse(cls, value: str | KVDtype) -> KVDtype:
        if isinstance(value, KVDtype):
            return value
        name = str(value).removeprefix("torch.").lower()
        name = _ALIASES.get(name, name)
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(d.value for d in cls)
            raise SpecError(f"unknown KV dtype {value!r}; expected one of: {known}") from None


_ITEMSIZE = {
    KVDtype.BFLOAT16: 2,
    KVDtype.FLOAT16: 2,
    KVDtype.FLOAT32: 4,
    KVDtype.FLOAT8_E4M3: 1,
    KVDtype.UINT8: 1,
}
_SCALE_BYTES = {KVDtype.FLOAT8_E4M3: 4}
_FLOATS = frozenset({KVDtype.BFLOAT16, KVDtype.FLOAT16, KVDtype.FLOAT32})
_CODES = {
    KVDtype.BFLOAT16: 1,
    KVDtype.FLOAT16: 2,
    KVDtype.FLOAT32: 3,
    KVDtype.FLOAT8_E4M3: 4,
    KVDtype.UINT8: 5,
}
_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
}

# Upper bounds that keep a hostile or mistyped spec from asking for absurd allocations.
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 65536
MAX_CHUNK_TOKENS = 1 << 16


def _positive(name: str, value: int, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SpecError(f"{name} must be an integer, got {type(value).__name__}")
    if value <= 0:
        raise SpecError(f"{name} must be positive, got {value}")
    if value > upper:
        raise SpecError(f"{name}={value} exceeds the limit {upper}")
    return int(value)


@dataclass(frozen=True)
class KVSpec:
    """Shape of one model's KV cache as kvfabric stores it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype = KVDtype.BFLOAT16
    kind: AttentionKind = AttentionKind.MHA
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_layers", _positive("num_layers", self.num_layers, MAX_LAYERS))
        object.__setattr__(
            self, "num_kv_heads", _positive("num_kv_heads", self.num_kv_heads, MAX_KV_HEADS)
        )
        object.__setattr__(self, "head_dim", _positive("head_dim", self.head_dim, MAX_HEAD_DIM))
        object.__setattr__(
            self, "chunk_tokens", _positive("chunk_tokens", self.chunk_tokens, MAX_CHUNK_TOKENS)
        )
        object.__setattr__(self, "dtype", KVDtype.parse(self.dtype))
        try:
            object.__setattr__(self, "kind", AttentionKind(self.kind))
        except ValueError:
            raise SpecError(
                f"unknown attention kind {self.kind!r}; expected 'mha' or 'mla'"
            ) from None
        if self.kind is AttentionKind.MLA and self.num_kv_heads != 1:
            raise SpecError(
                f"an MLA spec has one latent 'head', got num_kv_heads={self.num_kv_heads}"
            )

    @property
    def kv_planes(self) -> int:
        """2 (K and V) for MHA/GQA, 1 (the latent) for MLA."""
        return 1 if self.kind is AttentionKind.MLA else 2

    def layout(self, num_tokens: int | None = None) -> ChunkLayout:
        """The byte layout of a chunk of ``num_tokens`` tokens (a full chunk by default)."""
        return _layout(self, self.chunk_tokens if num_tokens is None else num_tokens)

    @property
    def chunk_bytes(self) -> int:
        return self.layout().nbytes

    def check_block_size(self, block_size: int) -> None:
        """Raise unless an engine with ``block_size``-token blocks can map onto our chunks."""
        block_size = _positive("block_size", block_size, MAX_CHUNK_TOKENS)
        if self.chunk_tokens % block_size:
            raise SpecError(
                f"chunk_tokens={self.chunk_tokens} is not a multiple of the engine block size "
                f"{block_size}; pick chunk_tokens as a multiple of every engine's block size"
            )

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes identifying this spec; identical on every machine and process."""
        packed = struct.pack(
            "<8sIIIBBI",
            b"KVSPEC01",
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype.code,
            self.kv_planes,
            self.chunk_tokens,
        )
        return xxhash.xxh3_128_digest(packed)

    def to_dict(self) -> dict[str, object]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype.value,
            "kind": self.kind.value,
            "chunk_tokens": self.chunk_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVSpec:
        allowed = {"num_layers", "num_kv_heads", "head_dim", "dtype", "kind", "chunk_tokens"}
        unknown = set(data) - allowed
        if unknown:
            raise SpecError(f"unknown KVSpec field(s): {', '.join(sorted(map(str, unknown)))}")
        try:
            return cls(**data)  # type: ignore[arg-type]
        except TypeError as exc:
            raise SpecError(f"incomplete KVSpec: {exc}") from None


@dataclass(frozen=True)
class ChunkLayout:
    """Byte geometry of one chunk payload in the canonical layout.

    ``[layer][plane][kv_head][token][head_dim]``, planes being K and V (MHA) or the latent (MLA).
    ``head_bytes`` is one (plane, head) record: its dtype's scale (float8 only) then its
    ``[token][head_dim]`` values.
    """

    spec: KVSpec
    num_tokens: int
    head_bytes: int = field(init=False)
    plane_bytes: int = field(init=False)
    layer_bytes: int = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        _positive("num_tokens", self.num_tokens, self.spec.chunk_tokens)
        dtype = self.spec.dtype
        head = dtype.scale_bytes + self.num_tokens * self.spec.head_dim * dtype.itemsize
        object.__setattr__(self, "head_bytes", head)
        object.__setattr__(self, "plane_bytes", head * self.spec.num_kv_heads)
        object.__setattr__(self, "layer_bytes", self.plane_bytes * self.spec.kv_planes)
        object.__setattr__(self, "nbytes", self.layer_bytes * self.spec.num_layers)

    def layer_range(self, layer: int) -> tuple[int, int]:
        """(offset, length) of one layer segment."""
        self._check_layer(layer)
        return layer * self.layer_bytes, self.layer_bytes

    def head_ranges(self, layer: int, head_start: int, head_end: int) -> list[tuple[int, int]]:
        """(offset, length) per plane of heads ``[head_start, head_end)`` in ``layer``.

        One contiguous run per plane: this is what a tensor-parallel rank reads or writes.
        """
        self._check_layer(layer)
        if not 0 <= head_start < head_end <= self.spec.num_kv_heads:
            raise SpecError(
                f"head range [{head_start}, {head_end}) outside [0, {self.spec.num_kv_heads})"
            )
        base = layer * self.layer_bytes + head_start * self.head_bytes
        length = (head_end - head_start) * self.head_bytes
        return [(base + p * self.plane_bytes, length) for p in range(self.spec.kv_planes)]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise SpecError(f"layer {layer} outside [0, {self.spec.num_layers})")


@functools.lru_cache(maxsize=4096)
def _layout(spec: KVSpec, num_tokens: int) -> ChunkLayout:
    """Layouts are immutable and asked for on every put and get: build each once."""
    return ChunkLayout(spec, num_tokens)


@dataclass(frozen=True)
class Namespace:
    """The scope of a chain of chunks: nothing is ever shared across namespaces.

    ``tenant_salt`` is vLLM's ``cache_salt`` where the engine has one; ``lora_id`` is the
    adapter name or id ('' for the base model).
    """

    model_id: str
    spec: KVSpec
    tenant_salt: str = ""
    lora_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise SpecError("model_id must be a non-empty string")
        if not isinstance(self.spec, KVSpec):
            raise SpecError(f"spec must be a KVSpec, got {type(self.spec).__name__}")
        for name in ("model_id", "tenant_salt", "lora_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value.encode()) > 4096:
                raise SpecError(f"{name} must be a string of at most 4096 bytes")

    @cached_property
    def seed(self) -> bytes:
        """16-byte seed mixed into every chunk hash of this namespace."""
        parts = [b"KVNS01", self.spec.fingerprint]
        for text in (self.model_id, self.tenant_salt, self.lora_id):
            raw = text.encode()
            parts.append(struct.pack("<I", len(raw)) + raw)  # length-prefixed: no ambiguity
        return xxhash.xxh3_128_digest(b"".join(parts))

    @property
    def tenant(self) -> str:
        return self.tenant_salt
