"""Conversion between one layer of a vLLM paged KV cache and kvfabric's canonical layout.

Contract: a :class:`PagedLayout` describes the paged KV cache tensor of one layer of one engine.
A request's token ``t`` lives in block ``block_ids[t // block_size]`` at offset
``t % block_size``. :meth:`PagedLayout.gather` returns tokens ``[start, start + num_tokens)``
of a request as the canonical contiguous ``[2, num_kv_heads, num_tokens, head_dim]`` tensor
(K then V), which is one layer's slice of kvfabric's ``[layer][k|v][kv_head][token][head_dim]``
chunk layout (MLA layouts, :mod:`.mla_layout`, have one plane, the latent, and one "head":
``[1, 1, num_tokens, latent_dim]``). :meth:`PagedLayout.scatter` is its inverse and writes
only those tokens' slots: the other slots of the same blocks may belong to other requests
and are left untouched. ``start`` need not be block-aligned. Both work on whole token
ranges: one strided copy per block run (the tokens a range has in one block), or tensor
indexing; never a Python loop per token.

Layouts:

- :class:`CudaBlockLayout`: vLLM's flash-attention cache ``[2, num_blocks, block_size,
  num_kv_heads, head_dim]`` (NHD, the logical shape vLLM hands to connectors whatever the
  physical stride order) or ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (HND).
- :class:`CpuBlockLayout`: vLLM's CPU attention cache ``[num_blocks, num_kv_heads, block_size,
  2 * head_dim]``, contiguous, whose arrangement inside a block depends on the kernel ISA. It is
  a per-block permutation of the canonical elements, derived exactly by
  :func:`probe_cpu_layout` from the engine's own cache-write kernel. Scatter calls that kernel
  itself when the probe finds it places strided (non-contiguous) input exactly as the
  permutation says: on ISAs without a strided closed form (``amx`` packs K and V in pairs) it
  is an order of magnitude faster than a per-element index. The "vec" ISA's layout (K stored
  transposed per block and head) is copied by :mod:`kvfabric.memory.strided`: a compiled
  cache-tiled transpose where the install built it, ``Tensor.copy_`` of strided views where not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal

import torch

from kvfabric.memory import strided

# key, value ([num_tokens, num_kv_heads, head_dim]), key_cache, value_cache (each a
# [num_blocks, num_kv_heads, block_size, head_dim] chunk of the cache viewed as
# [num_blocks, num_kv_heads, 2 * block_size, head_dim]) and slot_mapping ([num_tokens], int64):
# the calling convention of vLLM's torch.ops._C.cpu_attn_reshape_and_cache.
WriteKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

CudaOrder = Literal["NHD", "HND"]

# Every integer 0..256 is exact in bf16 (8-bit significand), fp16 and fp32, so one probe write
# carries one base-256 digit of every element's canonical index through the kernel unchanged.
_DIGIT_BASE = 256
_PROBE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Probe caches start filled with a value no digit can take, to catch slots a kernel skips.
_UNWRITTEN = -1.0


@dataclass(frozen=True)
class _Geometry:
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2  # K and V; 1 for MLA's latent

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "block_size", "head_dim", "planes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def block_numel(self) -> int:
        """Elements of all planes in one block: planes * num_kv_heads * block_size * head_dim."""
        return self.planes * self.num_kv_heads * self.block_size * self.head_dim

    def canonical_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.planes, self.num_kv_heads, num_tokens, self.head_dim)


@dataclass(frozen=True)
class _TokenSlots:
    """Tokens ``[start, end)`` of a request as runs (block id, first offset, first token,
    tokens), one per block touched: a run is one strided slice, so layouts that can copy by
    runs do a few large copies instead of per-token indexing. ``blocks`` and ``offsets``, the
    block id and in-block offset of each token on the cache's device, are built on first use:
    only the per-element paths need them, and building them costs more than a run's copy."""

    runs: tuple[tuple[int, int, int, int], ...]
    block_ids: torch.Tensor
    start: int
    end: int
    block_size: int
    device: torch.device

    @cached_property
    def _positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.end, device=self.device)

    @cached_property
    def blocks(self) -> torch.Tensor:
        return self.block_ids.to(self.device)[self._positions // self.block_size]

    @cached_property
    def offsets(self) -> torch.Tensor:
        return self._positions % self.block_size


class PagedLayout(ABC):
    """One layer's paged KV cache of one engine; see the module docstring for the contract."""

    planes: ClassVar[int] = 2  # canonical planes: K and V

    def __init__(self, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
        self._geometry = _Geometry(num_kv_heads, block_size, head_dim, dtype, self.planes)

    @property
    def block_size(self) -> int:
        return self._geometry.block_size

    @property
    def num_kv_heads(self) -> int:
        return self._geometry.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._geometry.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._geometry.dtype

    def gather(
        self,
        kv_layer: torch.Tensor,
        block_ids: torch.Tensor,
        start: int,
        num_tokens: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens ``[start, start + num_tokens)`` as canonical ``[planes, H, num_tokens, D]``.

        ``out``, when given, must be a contiguous tensor of that shape, dtype and device; it is
        filled and returned.
        """
        num_blocks = self._check_cache(kv_layer)
        slots = self._token_slots(block_ids, start, num_tokens, num_blocks, kv_layer.device)
        shape = self._geometry.canonical_shape(num_tokens)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=kv_layer.device)
        else:
            _check_tensor("out", out, shape, self.dtype, kv_layer.device)
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
        self._gather_into(kv_layer, slots, out)
        return out

    def scatter(
        self, kv_layer: torch.Tensor, block_ids: torch.Tensor, start: int, canonical: torch.Tensor
    ) -> None:
        """Write canonical ``[planes, H, T, D]`` into the slots of tokens ``[start, start + T)``."""
        num_blocks = self._check_cache(kv_layer)
        if not isinstance(canonical, torch.Tensor):
            raise TypeError(f"canonical must be a torch.Tensor, got {type(canonical).__name__}")
        if canonical.dim() != 4:
            raise ValueError(
                f"canonical must be [{self.planes}, H, T, D], got {list(canonical.shape)}"
            )
        num_tokens = canonical.shape[2]
        shape = self._geometry.canonical_shape(num_tokens)
        _check_tensor("canonical", canonical, shape, self.dtype, kv_layer.device)
        slots = self._token_slots(block_ids, start, num_tokens, num_blocks, kv_layer.device)
        self._scatter_from(kv_layer, slots, canonical)

    def _token_slots(
        self,
        block_ids: torch.Tensor,
        start: int,
        num_tokens: int,
        num_blocks: int,
        device: torch.device,
    ) -> _TokenSlots:
        if not isinstance(block_ids, torch.Tensor):
            raise TypeError(f"block_ids must be a torch.Tensor, got {type(block_ids).__name__}")
        if block_ids.dtype != torch.int64:
            raise ValueError(f"block_ids must be int64, got {block_ids.dtype}")
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
        for name, value in (("start", start), ("num_tokens", num_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        end = start + num_tokens
        block_size = self._geometry.block_size
        first_block, end_block = start // block_size, -(-end // block_size)
        if block_ids.numel() < end_block:
            raise ValueError(
                f"tokens [{start}, {end}) need {end_block} block ids, got {block_ids.numel()}"
            )
        covered = block_ids[first_block:end_block].tolist() if num_tokens else []
        if covered and (min(covered) < 0 or max(covered) >= num_blocks):
            raise ValueError(f"block ids of tokens [{start}, {end}) not in [0, {num_blocks})")
        runs = []
        for index, block in enumerate(covered, start=first_block):
            first = max(start, index * block_size)
            last = min(end, (index + 1) * block_size)
            runs.append((block, first - index * block_size, first - start, last - first))
        return _TokenSlots(tuple(runs), block_ids, start, end, block_size, device)

    def _check_cache_dtype(self, kv_layer: torch.Tensor) -> None:
        if kv_layer.dtype != self.dtype:
            raise ValueError(f"kv_layer dtype {kv_layer.dtype} != layout dtype {self.dtype}")

    @abstractmethod
    def _check_cache(self, kv_layer: torch.Tensor) -> int:
        """Raise ValueError unless kv_layer has this layout's shape and dtype; return num_blocks."""

    @abstractmethod
    def _gather_into(self, kv_layer: torch.Tensor, slots: _TokenSlots, out: torch.Tensor) -> None:
        """Fill canonical ``out`` from the tokens' slots."""

    @abstractmethod
    def _scatter_from(
        self, kv_layer: torch.Tensor, slots: _TokenSlots, canonical: torch.Tensor
    ) -> None:
        """Write canonical data into the tokens' slots."""


def _check_tensor(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} dtype {tensor.dtype} != layout dtype {dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, kv_layer on {device}")


def _gather_tokens(blocked: torch.Tensor, slots: _TokenSlots, out: torch.Tensor) -> None:
    """Fill ``out`` [..., T, D] from ``blocked`` [..., nb, bs, D] at the tokens' slots: one
    strided copy per block run (a strided copy beats per-token indexing several times)."""
    for block, offset, token, count in slots.runs:
        out[..., token : token + count, :].copy_(blocked[..., block, offset : offset + count, :])


def _scatter_tokens(blocked: torch.Tensor, slots: _TokenSlots, source: torch.Tensor) -> None:
    """Write ``source`` [..., T, D] into ``blocked`` [..., nb, bs, D] at the tokens' slots."""
    for block, offset, token, count in slots.runs:
        blocked[..., block, offset : offset + count, :].copy_(source[..., token : token + count, :])


class CudaBlockLayout(PagedLayout):
    """vLLM flash-attention cache: ``[2, nb, bs, H, D]`` (NHD) or ``[2, nb, H, bs, D]`` (HND).

    vLLM hands connectors the NHD logical shape even when the physical stride order is HND;
    indexing goes through the tensor's strides, so NHD is right for both. ``order="HND"`` is
    for caches whose logical shape is head-major.
    """

    def __init__(
        self,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        order: CudaOrder = "NHD",
    ):
        super().__init__(num_kv_heads, block_size, head_dim, dtype)
        if order not in ("NHD", "HND"):
            raise ValueError(f"order must be 'NHD' or 'HND', got {order!r}")
        self.order: CudaOrder = order

    def _block_shape(self) -> tuple[int, int, int]:
        g = self._geometry
        if self.order == "NHD":
            return (g.block_size, g.num_kv_heads, g.head_dim)
        return (g.num_kv_heads, g.block_size, g.head_dim)

    def _check_cache(self, kv_layer: torch.Tensor) -> int:
        self._check_cache_dtype(kv_layer)
        shape = tuple(kv_layer.shape)
        if len(shape) != 5 or shape[0] != 2 or shape[2:] != self._block_shape():
            expected = ("2", "num_blocks", *map(str, self._block_shape()))
            raise ValueError(
                f"{self.order} kv_layer must be [{', '.join(expected)}], got {list(shape)}"
            )
        return shape[1]

    def _blocked(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """The cache as a [2, H, nb, bs, D] view."""
        return kv_layer.permute(0, 3, 1, 2, 4) if self.order == "NHD" else kv_layer.transpose(1, 2)

    def _gather_into(self, kv_layer: torch.Tensor, slots: _TokenSlots, out: torch.Tensor) -> None:
        _gather_tokens(self._blocked(kv_layer), slots, out)

    def _scatter_from(
        self, kv_layer: torch.Tensor, slots: _TokenSlots, canonical: torch.Tensor
    ) -> None:
        _scatter_tokens(self._blocked(kv_layer), slots, canonical)


class CpuBlockLayout(PagedLayout):
    """vLLM CPU attention cache ``[nb, H, bs, 2 * D]``, contiguous, as a per-block permutation.

    ``perm[c]`` is the element index, within one block's memory, of canonical element ``c`` of
    that block in ``[2][H][bs][D]`` order. When ``perm`` is :meth:`transposed_k`'s closed form,
    gather and scatter index strided K and V views instead of per-element positions.

    ``write_kernel``, when given, is the engine's cache-write kernel, which must place every
    element where ``perm`` says, for key and value views with any token and head strides
    (:func:`probe_cpu_layout` checks that before passing it); scatter then writes through it
    instead of a per-element index (the transposed-K views stay as fast, and are kept).
    """

    def __init__(
        self,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        perm: torch.Tensor,
        write_kernel: WriteKernel | None = None,
    ):
        super().__init__(num_kv_heads, block_size, head_dim, dtype)
        n = self._geometry.block_numel
        if perm.dtype != torch.int64 or tuple(perm.shape) != (n,):
            raise ValueError(f"perm must be an int64 tensor of shape ({n},)")
        if not torch.equal(torch.sort(perm).values, torch.arange(n)):
            raise ValueError(f"perm is not a permutation of 0..{n - 1}")
        self.perm = perm.cpu()
        self.is_transposed_k = torch.equal(self.perm, _transposed_k_perm(self._geometry))
        self._perm_canonical = self.perm.view(self._geometry.canonical_shape(block_size))
        self.write_kernel = None if self.is_transposed_k else write_kernel

    @classmethod
    def transposed_k(
        cls, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
    ) -> CpuBlockLayout:
        """The "vec" ISA layout: per (block, head), K as ``[D, bs]`` then V as ``[bs, D]``."""
        geometry = _Geometry(num_kv_heads, block_size, head_dim, dtype)
        return cls(num_kv_heads, block_size, head_dim, dtype, perm=_transposed_k_perm(geometry))

    def _check_cache(self, kv_layer: torch.Tensor) -> int:
        self._check_cache_dtype(kv_layer)
        g = self._geometry
        block = (g.num_kv_heads, g.block_size, 2 * g.head_dim)
        if kv_layer.dim() != 4 or tuple(kv_layer.shape[1:]) != block:
            raise ValueError(
                f"CPU kv_layer must be [num_blocks, {', '.join(map(str, block))}], "
                f"got {list(kv_layer.shape)}"
            )
        # The permutation addresses raw block memory, which only a contiguous tensor exposes.
        if not kv_layer.is_contiguous():
            raise ValueError("CPU kv_layer must be contiguous")
        return kv_layer.shape[0]

    def _gather_into(self, kv_layer: torch.Tensor, slots: _TokenSlots, out: torch.Tensor) -> None:
        if self.is_transposed_k:
            self._copy_transposed_k(kv_layer, slots, out, into_cache=False)
        else:
            torch.take(kv_layer, self._element_indices(slots), out=out)

    def _scatter_from(
        self, kv_layer: torch.Tensor, slots: _TokenSlots, canonical: torch.Tensor
    ) -> None:
        if self.is_transposed_k:
            self._copy_transposed_k(kv_layer, slots, canonical, into_cache=True)
        elif self.write_kernel is not None and canonical.stride(-1) == 1:
            if slots.runs:
                _kernel_write(self.write_kernel, kv_layer, slots, canonical)
        else:
            kv_layer.view(-1).index_put_((self._element_indices(slots),), canonical)

    def _copy_transposed_k(
        self,
        kv_layer: torch.Tensor,
        slots: _TokenSlots,
        canonical: torch.Tensor,
        *,
        into_cache: bool,
    ) -> None:
        """Copy between the cache and canonical [2, H, T, D] (any strides) in the transposed-K
        layout: per block run, K as one [H, tokens, D] transposed copy (each head's block is
        [D, bs]) and V as one plain one, addressed by offsets and strides: building views
        would cost more than a run's copy."""
        g = self._geometry
        heads, block_size, head_dim = g.num_kv_heads, g.block_size, g.head_dim
        head = 2 * block_size * head_dim  # elements of one (block, head): K then V
        block_numel = heads * head
        plane, head_stride, token_stride, dim_stride = canonical.stride()
        canonical_strides = (head_stride, token_stride, dim_stride)
        key_strides = (head, 1, block_size)
        value_strides = (head, head_dim, 1)
        regions = []
        for block, offset, token, count in slots.runs:
            shape = (heads, count, head_dim)
            key_at = block * block_numel + offset
            value_at = key_at + head // 2 + offset * (head_dim - 1)
            at = token * token_stride
            if into_cache:
                regions += [
                    strided.Region(key_at, key_strides, at, canonical_strides, shape),
                    strided.Region(value_at, value_strides, plane + at, canonical_strides, shape),
                ]
            else:
                regions += [
                    strided.Region(at, canonical_strides, key_at, key_strides, shape),
                    strided.Region(plane + at, canonical_strides, value_at, value_strides, shape),
                ]
        if into_cache:
            strided.copy(kv_layer, canonical, regions)
        else:
            strided.copy(canonical, kv_layer, regions)

    def _element_indices(self, slots: _TokenSlots) -> torch.Tensor:
        """Flat cache element index of every canonical element, shaped [2, H, T, D]."""
        perm = self._perm_canonical.to(slots.blocks.device)
        block_base = slots.blocks * self._geometry.block_numel
        return perm[:, :, slots.offsets, :] + block_base.view(1, 1, -1, 1)


def probe_cpu_layout(
    write_kernel: WriteKernel,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> CpuBlockLayout:
    """Derive the CPU block layout by letting the engine's cache-write kernel place known data.

    Each probe write fills one scratch block with, per canonical element, one base-256 digit of
    that element's canonical index; reading the block back tells, for every memory element,
    which canonical element landed there. Raises ValueError if the kernel leaves an element
    unwritten or does not place every canonical element exactly once.
    """
    geometry = _Geometry(num_kv_heads, block_size, head_dim, dtype)
    if dtype not in _PROBE_DTYPES:
        raise ValueError(f"cannot probe dtype {dtype}; supported: {_PROBE_DTYPES}")
    n = geometry.block_numel
    canonical_index = torch.arange(n).view(geometry.canonical_shape(block_size))
    source = torch.zeros(n, dtype=torch.int64)  # memory element -> canonical index
    place = 1
    while place < n:
        digit = (canonical_index // place) % _DIGIT_BASE
        source += _probe_write(write_kernel, geometry, digit.to(dtype)).to(torch.int64) * place
        place *= _DIGIT_BASE
    if not torch.equal(torch.sort(source).values, torch.arange(n)):
        raise ValueError("write kernel does not place each element of a block exactly once")
    perm = torch.empty(n, dtype=torch.int64)
    perm[source] = torch.arange(n)
    probed = CpuBlockLayout(num_kv_heads, block_size, head_dim, dtype, perm=perm)
    if probed.is_transposed_k or not _writes_strided_input_like(write_kernel, probed):
        return probed
    return CpuBlockLayout(
        num_kv_heads, block_size, head_dim, dtype, perm=perm, write_kernel=write_kernel
    )


def _kernel_write(
    write_kernel: WriteKernel, kv_layer: torch.Tensor, slots: _TokenSlots, canonical: torch.Tensor
) -> None:
    """Write canonical [2, H, T, D] (any strides, contiguous last dim) through the kernel."""
    num_blocks, heads, block_size, width = kv_layer.shape
    # Exactly how vLLM's do_kv_cache_update presents the cache to the kernel.
    key_cache, value_cache = kv_layer.view(num_blocks, heads, 2 * block_size, width // 2).chunk(
        2, dim=2
    )
    key, value = canonical[0].transpose(0, 1), canonical[1].transpose(0, 1)  # [T, H, D] views
    write_kernel(key, value, key_cache, value_cache, slots.blocks * block_size + slots.offsets)


def _writes_strided_input_like(write_kernel: WriteKernel, probed: CpuBlockLayout) -> bool:
    """Whether the kernel, given [T, H, D] views of a token slice of a canonical tensor (as
    scatter passes them), writes exactly the bytes the probed permutation's index scatter
    writes, and nothing else: an unaligned range over out-of-order blocks, into random data."""
    g = probed._geometry
    generator = torch.Generator().manual_seed(0)
    num_blocks = 4

    def random(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(g.dtype)

    by_index = random((num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim))
    by_kernel = by_index.clone()
    block_ids = torch.tensor([2, 0, 3], dtype=torch.int64)
    start, num_tokens = g.block_size // 2 + 1, g.block_size + 3
    canonical = random(g.canonical_shape(num_tokens + 5))[:, :, 2 : 2 + num_tokens]
    slots = probed._token_slots(block_ids, start, num_tokens, num_blocks, by_index.device)
    by_index.view(-1).index_put_((probed._element_indices(slots),), canonical)
    try:
        _kernel_write(write_kernel, by_kernel, slots, canonical)
    except (RuntimeError, ValueError):
        return False
    bits = {2: torch.int16, 4: torch.int32}[g.dtype.itemsize]
    return torch.equal(by_kernel.view(bits), by_index.view(bits))


def _probe_write(
    write_kernel: WriteKernel, geometry: _Geometry, canonical: torch.Tensor
) -> torch.Tensor:
    """Write one block's canonical [2, H, bs, D] through the kernel; return its flat memory."""
    g = geometry
    cache = torch.full((1, g.num_kv_heads, g.block_size, 2 * g.head_dim), _UNWRITTEN, dtype=g.dtype)
    # Exactly how vLLM's do_kv_cache_update presents the cache to the kernel.
    key_cache, value_cache = cache.view(1, g.num_kv_heads, 2 * g.block_size, -1).chunk(2, dim=2)
    key, value = (half.transpose(0, 1).contiguous() for half in canonical)  # [bs, H, D]
    slot_mapping = torch.arange(g.block_size, dtype=torch.int64)
    write_kernel(key, value, key_cache, value_cache, slot_mapping)
    memory = cache.view(-1)
    unwritten = int((memory == _UNWRITTEN).sum())
    if unwritten:
        raise ValueError(f"write kernel left {unwritten} of {memory.numel()} elements unwritten")
    return memory


def _transposed_k_perm(geometry: _Geometry) -> torch.Tensor:
    g = geometry
    head = torch.arange(g.num_kv_heads).view(-1, 1, 1) * (2 * g.block_size * g.head_dim)
    token = torch.arange(g.block_size).view(1, -1, 1)
    dim = torch.arange(g.head_dim).view(1, 1, -1)
    key = head + dim * g.block_size + token
    value = head + g.block_size * g.head_dim + token * g.head_dim + dim
    return torch.stack([key, value]).reshape(-1)


def vllm_cpu_write_kernel(isa: str) -> WriteKernel:
    """vLLM's CPU cache-write kernel for ``isa``, as do_kv_cache_update calls it (no scaling)."""
    # Deferred: importing vLLM takes seconds, and kvfabric itself runs without it.
    from vllm import _custom_ops as ops

    def write(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        ops.cpu_attn_reshape_and_cache(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )

    return write


def layout_for_vllm_cache(
    kv_layer: torch.Tensor,
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device_type: str,
    isa: str | None,
) -> PagedLayout:
    """The layout of one layer's vLLM KV cache, chosen by the engine's device type and shape.

    ``device_type`` is the vLLM platform's ("cpu" or "cuda"). On "cpu" the layout is probed
    with vLLM's write kernel for ``isa``; ``None`` takes the ISA vLLM's CPU backend picks for
    this dtype, block size and head size (with an unquantized cache).
    """
    shape = tuple(kv_layer.shape)
    if device_type == "cpu":
        if len(shape) != 4 or shape[1:] != (num_kv_heads, block_size, 2 * head_dim):
            raise ValueError(
                f"vLLM CPU cache layer must be [num_blocks, {num_kv_heads}, {block_size}, "
                f"{2 * head_dim}], got {list(shape)}"
            )
        chosen = isa if isa is not None else _vllm_cpu_isa(kv_layer.dtype, block_size, head_dim)
        return probe_cpu_layout(
            vllm_cpu_write_kernel(chosen), num_kv_heads, block_size, head_dim, kv_layer.dtype
        )
    if device_type == "cuda":
        order = _cuda_order(shape, block_size, num_kv_heads, head_dim)
        if order is None:
            raise ValueError(
                f"vLLM CUDA cache layer must be [2, num_blocks, {block_size}, {num_kv_heads}, "
                f"{head_dim}] (NHD) or [2, num_blocks, {num_kv_heads}, {block_size}, "
                f"{head_dim}] (HND), got {list(shape)}"
            )
        return CudaBlockLayout(num_kv_heads, block_size, head_dim, kv_layer.dtype, order=order)
    raise ValueError(f"unsupported device_type {device_type!r}; expected 'cpu' or 'cuda'")


def _cuda_order(
    shape: tuple[int, ...], block_size: int, num_kv_heads: int, head_dim: int
) -> CudaOrder | None:
    if len(shape) != 5 or shape[0] != 2:
        return None
    # NHD first: when block_size == num_kv_heads the shapes coincide, and vLLM's
    # flash-attention backend hands connectors the NHD logical shape.
    if shape[2:] == (block_size, num_kv_heads, head_dim):
        return "NHD"
    if shape[2:] == (num_kv_heads, block_size, head_dim):
        return "HND"
    return None


def _vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)
