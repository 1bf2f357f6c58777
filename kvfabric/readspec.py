"""What a consumer wants a chunk as: the read half of "one canonical object, many consumers".

A decode engine rarely wants the canonical object exactly as stored: it may run another
dtype (bf16 KV into an fp32 CPU model), hold only its tensor-parallel rank's KV heads, or
lay a layer out token-major. A :class:`ReadSpec` says so. It travels in the ``get`` request
(``Client.get(..., want=ReadSpec(...))``), so the daemon validates it against the chunk's
namespace before pinning anything (a bad spec is a clear :class:`~kvfabric.errors.SpecError`,
never a torn read) and counts the conversions per kind; the bytes are then converted where
it is cheapest. Conversions that grow the data (up-casts, layouts) and every local read run
on the consumer, straight from the pinned shared pages: the daemon process never copies the
payload, and a spec that changes nothing reads as a zero-copy view
(:func:`kvfabric.convert.request.read_layer_as`).

Layouts of one layer: ``"hnd"`` is the canonical ``[planes, heads, tokens, head_dim]``;
``"nhd"`` is ``[planes, tokens, heads, head_dim]`` (vLLM's CUDA block layout, flattened).

Tensor parallelism (:func:`tp_head_range`): with ``tp_size`` ranks and ``H`` KV heads, rank
``r`` holds heads ``[r*H/tp, (r+1)*H/tp)`` when ``tp_size`` divides ``H``; when ``tp_size``
is a multiple of ``H`` (GQA replication) each head is replicated on ``tp_size / H`` ranks and
rank ``r`` holds head ``r // (tp_size / H)``. A latent (MLA) object has no head split: every
rank reads all of it.

Frozen and hashable; no torch import (the protocol layer carries it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

from kvfabric.errors import SpecError
from kvfabric.spec import AttentionKind, KVDtype, KVSpec

HeadRange = tuple[int, int]


class KVLayout(str, Enum):
    """Dense layouts a consumer can ask one layer in."""

    HND = "hnd"  # canonical: [planes, heads, tokens, head_dim]
    NHD = "nhd"  # token-major: [planes, tokens, heads, head_dim]


class Conversion(str, Enum):
    """Kinds of work a read spec asks for (the daemon's conversion metrics count these)."""

    DTYPE = "dtype"
    HEADS = "heads"
    LAYOUT = "layout"


_WIRE_KEYS = frozenset({"dtype", "heads", "layout"})


def tp_head_range(spec: KVSpec, tp_rank: int, tp_size: int) -> HeadRange:
    """KV heads ``[start, end)`` of the canonical object that tensor-parallel rank
    ``tp_rank`` of ``tp_size`` holds (see the module docstring for GQA and MLA)."""
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{name} must be an int, got {value!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise SpecError(f"tensor-parallel rank {tp_rank} of {tp_size} is not a rank")
    heads = spec.num_kv_heads
    if spec.kind is AttentionKind.MLA:
        return (0, heads)
    if heads % tp_size == 0:
        per_rank = heads // tp_size
        return (tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % heads == 0:
        head = tp_rank // (tp_size // heads)
        return (head, head + 1)
    raise SpecError(
        f"tensor parallelism {tp_size} neither divides nor is a multiple of the {heads} KV heads"
    )


def tp_writes(spec: KVSpec, tp_rank: int, tp_size: int) -> bool:
    """Whether rank ``tp_rank`` writes its head range: with replicated heads (GQA with more
    ranks than heads, or MLA) only the first replica of each range does."""
    start, _ = tp_head_range(spec, tp_rank, tp_size)
    return tp_rank == 0 or tp_head_range(spec, tp_rank - 1, tp_size)[0] != start


@dataclass(frozen=True)
class ReadSpec:
    """A consumer's wanted dtype (None: as stored), KV-head range (None: all) and layout."""

    dtype: KVDtype | None = None
    heads: HeadRange | None = None
    layout: KVLayout = KVLayout.HND

    def __post_init__(self) -> None:
        if self.dtype is not None:
            object.__setattr__(self, "dtype", KVDtype.parse(self.dtype))
        if self.heads is not None:
            heads = tuple(self.heads)
            if (
                len(heads) != 2
                or any(isinstance(h, bool) or not isinstance(h, int) for h in heads)
                or not 0 <= heads[0] < heads[1]
            ):
                raise SpecError(f"heads must be a [start, end) pair of ints, got {self.heads!r}")
            object.__setattr__(self, "heads", heads)
        try:
            object.__setattr__(self, "layout", KVLayout(self.layout))
        except ValueError:
            raise SpecError(
                f"unknown layout {self.layout!r}; expected one of {[k.value for k in KVLayout]}"
            ) from None

    @classmethod
    def for_rank(
        cls,
        spec: KVSpec,
        tp_rank: int,
        tp_size: int,
        *,
        dtype: KVDtype | str | None = None,
        layout: KVLayout | str = KVLayout.HND,
    ) -> ReadSpec:
        """The spec of tensor-parallel rank ``tp_rank`` of ``tp_size`` (its KV heads)."""
        heads = tp_head_range(spec, tp_rank, tp_size)
        return cls(
            None if dtype is None else KVDtype.parse(dtype),
            None if heads == (0, spec.num_kv_heads) else heads,
            KVLayout(layout),
        )

    def check(self, spec: KVSpec) -> None:
        """Raise SpecError unless this spec can be served from objects of ``spec``."""
        if self.heads is not None and self.heads[1] > spec.num_kv_heads:
            raise SpecError(
                f"heads [{self.heads[0]}, {self.heads[1]}) outside the "
                f"{spec.num_kv_heads} KV heads of the namespace"
            )
        if self.dtype is not None and not spec.dtype.reads_as(self.dtype):
            floats = ", ".join(d.value for d in KVDtype if d.is_float)
            raise SpecError(
                f"no conversion from {spec.dtype.value} to {self.dtype.value} on "
                f"read; conversions run between {floats} and from "
                f"{KVDtype.FLOAT8_E4M3.value} to those"
            )

    def conversions(self, spec: KVSpec) -> tuple[Conversion, ...]:
        """What reading an object of ``spec`` this way changes (empty: a zero-copy read)."""
        out = []
        if self.dtype is not None and self.dtype != spec.dtype:
            out.append(Conversion.DTYPE)
        if self.heads is not None and self.heads != (0, spec.num_kv_heads):
            out.append(Conversion.HEADS)
        if self.layout is not KVLayout.HND and spec.num_kv_heads > 1:
            out.append(Conversion.LAYOUT)
        return tuple(out)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": self.layout.value}
        if self.dtype is not None:
            out["dtype"] = self.dtype.value
        if self.heads is not None:
            out["heads"] = list(self.heads)
        return out

    @classmethod
    def from_wire(cls, raw: Any) -> ReadSpec:
        """Parse a request's ``want``; every malformed value is a SpecError."""
        if not isinstance(raw, dict):
            raise SpecError("want must be a map")
        unknown = set(raw) - _WIRE_KEYS
        if unknown:
            raise SpecError(f"unknown keys in want: {sorted(map(str, unknown))}")
        dtype, heads, layout = raw.get("dtype"), raw.get("heads"), raw.get("layout", "hnd")
        if dtype is not None and not isinstance(dtype, str):
            raise SpecError("want.dtype must be a string")
        if heads is not None and not isinstance(heads, list):
            raise SpecError("want.heads must be a [start, end] list")
        if not isinstance(layout, str):
            raise SpecError("want.layout must be a string")
        return cls(
            None if dtype is None else KVDtype.parse(dtype),
            None if heads is None else tuple(heads),
            cast(KVLayout, layout),  # __post_init__ turns it into a KVLayout or a SpecError
        )
