"""Conversion between one layer of vLLM's MLA (multi-head latent attention) cache and
kvfabric's canonical MLA layout.

MLA models (DeepSeek-V2/V3 and their kin) cache one latent vector per token, shared by all
attention heads: the compressed KV (``kv_lora_rank`` values) followed by the rotary part of
the key (``qk_rope_head_dim``), ``latent_dim`` values in all (576 for DeepSeek). There is no
separate K and V and no per-head data, so the canonical form (``AttentionKind.MLA`` in
:mod:`kvfabric.spec`) has one plane and one "head": tokens ``[start, start + T)`` of a request
are the contiguous ``[1, 1, T, latent_dim]`` tensor.

vLLM hands a connector each MLA layer as ``[num_blocks, 1, block_size, latent_dim]`` (its
logical ``[blocks, heads, tokens, channels]`` cache shape with a single head; vLLM 0.32, CPU)
or ``[num_blocks, block_size, latent_dim]`` (the shape of vLLM's MLA backends before that).
A token's latent is the row of its slot (``block * block_size + offset``): that is where
every cache-write of vLLM's MLA backends puts it (``concat_and_cache_mla`` on CUDA,
``concat_and_cache_mla_cpu`` of the AMX backend, the CPU reference backend's row indexing),
and the tests check this against vLLM's own writers. Gather and scatter go through the
tensor's strides (one strided copy per block run), so any physical order of the axes works.

:class:`MlaBlockLayout` keeps :class:`.layout.PagedLayout`'s contract: whole token ranges,
``start`` need not be block-aligned, scatter writes only the request's slots.

Tensor parallelism: vLLM replicates the latent on every rank, so every rank's cache holds all
of it and uses this same layout; only the first rank saves it (:func:`.namespace.rank_share`).
"""

from __future__ import annotations

import torch

from .layout import PagedLayout, _gather_tokens, _scatter_tokens, _TokenSlots


class MlaBlockLayout(PagedLayout):
    """vLLM's MLA cache ``[nb, 1, bs, latent_dim]`` or ``[nb, bs, latent_dim]``; canonical
    ``[1, 1, T, latent_dim]``."""

    planes = 1  # the latent; no separate K and V

    def __init__(self, block_size: int, latent_dim: int, dtype: torch.dtype):
        super().__init__(1, block_size, latent_dim, dtype)

    @property
    def latent_dim(self) -> int:
        return self.head_dim

    def _check_cache(self, kv_layer: torch.Tensor) -> int:
        self._check_cache_dtype(kv_layer)
        return self._rows(kv_layer).shape[0]

    def _rows(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """The cache as a ``[nb, bs, latent_dim]`` view; ValueError for any other shape."""
        g = self._geometry
        shape = tuple(kv_layer.shape)
        if shape[-2:] == (g.block_size, g.head_dim):
            if len(shape) == 3:
                return kv_layer
            if len(shape) == 4 and shape[1] == 1:
                return kv_layer.select(1, 0)
        raise ValueError(
            f"vLLM MLA cache layer must be [num_blocks, 1, {g.block_size}, {g.head_dim}] or "
            f"[num_blocks, {g.block_size}, {g.head_dim}], got {list(shape)}"
        )

    def _blocked(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """The cache as a [1, 1, nb, bs, latent_dim] view, the shape the run copies take."""
        return self._rows(kv_layer)[None, None]

    def _gather_into(self, kv_layer: torch.Tensor, slots: _TokenSlots, out: torch.Tensor) -> None:
        _gather_tokens(self._blocked(kv_layer), slots, out)

    def _scatter_from(
        self, kv_layer: torch.Tensor, slots: _TokenSlots, canonical: torch.Tensor
    ) -> None:
        _scatter_tokens(self._blocked(kv_layer), slots, canonical)


def mla_layout_for_vllm_cache(
    kv_layer: torch.Tensor, *, block_size: int, latent_dim: int
) -> MlaBlockLayout:
    """The layout of one MLA layer's vLLM cache, on any device (the latent rows are laid out
    alike on CPU and CUDA). Raises ValueError at once when the layer's shape or block size
    is not what the engine's spec says, rather than at the first save or load."""
    layout = MlaBlockLayout(block_size, latent_dim, kv_layer.dtype)
    layout._check_cache(kv_layer)
    return layout
