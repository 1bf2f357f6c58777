"""Conversion between a page of SGLang's host KV pool and kvfabric's canonical chunk.

SGLang's HiCache keeps KV in a host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``
in ``sglang.srt.mem_cache.pool_host``) whose ``kv_buffer`` is laid out by ``--hicache-mem-
layout``; ``pool.get_data_page(index, flat=False)`` is a view of the page that starts at token
slot ``index`` and ``get_data_page(index)`` / ``set_from_flat_data_page`` move the same page
flattened, in that same order. Page shapes (P tokens per page, L layers, H KV heads, D head
size, ``1`` the page axis of the ``*_direct`` / ``page_head`` layouts, MLA's latent as one
head)::

    MHA layer_first        [2, L, P, H, D]         MLA layer_first        [L, P, 1, D]
    MHA page_first         [2, P, L, H, D]         MLA page_first         [P, L, 1, D]
    MHA page_first_direct  [2, 1, L, P, H, D]      MLA page_first_direct  [1, L, P, 1, D]
    MHA page_head          [2, 1, H, P, L, D]

kvfabric stores a page as one chunk of P tokens in its canonical ``[L][k|v][H][P][D]``
layout, so engines with any host layout (and the copying and zero-copy paths of one
engine) share the same bytes. :meth:`PageLayout.canonical` turns a page view or a flat page
into a strided view of canonical shape without copying; :func:`write_chunk` /
:func:`read_chunk` copy one such view to or from a daemon chunk layer by layer, straight
between the pool and the daemon's shared pages. Not thread-safe per chunk handle; a
``PageLayout`` is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.payload import PayloadReader, PayloadWriter
from kvfabric.spec import AttentionKind, KVDtype, KVSpec

# layout -> (page shape with the page axis dropped, in the names below; permutation of it
# into the canonical [L, planes, H, P, D])
_MHA = {
    "layer_first": ("2LPHD", (1, 0, 3, 2, 4)),
    "page_first": ("2PLHD", (2, 0, 3, 1, 4)),
    "page_first_direct": ("2LPHD", (1, 0, 3, 2, 4)),
    "page_head": ("2HPLD", (3, 0, 1, 2, 4)),
}
# MLA pages carry the latent as one "head": viewed with a plane axis of 1 ("1").
_MLA = {
    "layer_first": ("LP1HD", (0, 2, 3, 1, 4)),
    "page_first": ("PL1HD", (1, 2, 3, 0, 4)),
    "page_first_direct": ("LP1HD", (0, 2, 3, 1, 4)),
}


@dataclass(frozen=True)
class PageLayout:
    """How one host pool's pages map onto kvfabric chunks of :attr:`spec`."""

    spec: KVSpec
    layout: str
    dtype: torch.dtype
    page_shape: tuple[int, ...]
    permutation: tuple[int, ...]

    @classmethod
    def of_pool(cls, pool: Any, is_mla: bool) -> PageLayout:
        """The layout of SGLang's registered host pool; ValueError if unsupported."""
        layout = str(pool.layout)
        table = _MLA if is_mla else _MHA
        if layout not in table:
            raise ValueError(
                f"kvfabric HiCache storage supports host layouts "
                f"{sorted(table)} for {'MLA' if is_mla else 'MHA'} pools, "
                f"not {layout!r}"
            )
        if getattr(pool, "dcp_size", 1) != 1:
            raise ValueError(
                "kvfabric HiCache storage does not support decode context "
                "parallelism (dcp_size > 1) yet"
            )
        if is_mla:
            heads, head_dim = 1, int(pool.kv_cache_dim)
        else:
            heads, head_dim = int(pool.head_num), int(pool.head_dim)
            if int(getattr(pool, "v_head_dim", head_dim)) != head_dim:
                raise ValueError(
                    "kvfabric stores K and V of one head size; this pool has "
                    f"head_dim={head_dim}, v_head_dim={pool.v_head_dim}"
                )
        sizes = {
            "2": 2,
            "1": 1,
            "L": int(pool.layer_num),
            "P": int(pool.page_size),
            "H": heads,
            "D": head_dim,
        }
        names, permutation = table[layout]
        spec = KVSpec(
            num_layers=sizes["L"],
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=KVDtype.parse(str(pool.dtype)),
            kind=AttentionKind.MLA if is_mla else AttentionKind.MHA,
            chunk_tokens=sizes["P"],
        )
        return cls(spec, layout, pool.dtype, tuple(sizes[n] for n in names), permutation)

    @property
    def page_tokens(self) -> int:
        return self.spec.chunk_tokens

    def canonical(self, page: torch.Tensor) -> torch.Tensor:
        """A page view (``get_data_page(i, flat=False)``) or a flat page
        (``get_data_page(i)``) as a strided ``[L, planes, H, P, D]`` view of the same memory.
        """
        if page.dtype != self.dtype:
            raise ValueError(f"page dtype {page.dtype} is not the pool's {self.dtype}")
        return page.view(self.page_shape).permute(self.permutation)


def write_chunk(writer: PayloadWriter, canonical: torch.Tensor) -> None:
    """Copy a canonical page into a reserved chunk (not committed here)."""
    for layer in range(canonical.shape[0]):
        pieces = writer.layer_pieces(layer)
        if len(pieces) == 1:  # the layer is one run of a daemon page: no staging copy
            _typed(pieces[0], canonical[layer]).copy_(canonical[layer])
        else:
            writer.write_layer(layer, canonical[layer].contiguous())


def read_chunk(reader: PayloadReader, canonical: torch.Tensor, timeout: float) -> None:
    """Copy a chunk into a canonical page view, waiting for layers still being written."""
    for layer in range(canonical.shape[0]):
        reader.wait_layer(layer, timeout)  # type: ignore[attr-defined]
        pieces = reader.layer_pieces(layer)
        if len(pieces) == 1:
            canonical[layer].copy_(_typed(pieces[0], canonical[layer]))
        else:
            staging = torch.empty(canonical[layer].shape, dtype=canonical.dtype)
            reader.read_into(staging, layer=layer)
            canonical[layer].copy_(staging)


def _typed(piece: Any, like: torch.Tensor) -> torch.Tensor:
    """A uint8 page piece (numpy view of shared memory) as a tensor shaped like ``like``."""
    raw = piece if isinstance(piece, torch.Tensor) else torch.from_numpy(piece)
    return raw.view(like.dtype).view(like.shape)
