"""vLLM's transposed-K CPU layout moves the same bits with the compiled strided kernel and
with its torch fallback, for every dtype the CPU cache takes, against an index reference."""

from __future__ import annotations

import pytest
import torch

from kvfabric.memory import native
from kvfabric_connectors.vllm import layout

# Sizes off the kernel's 8x8 register tiles (head_dim 40, partial blocks) and the real one.
GEOMETRIES = [(3, 32, 40), (2, 128, 128)]  # (kv heads, block size, head dim)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {2: torch.int16, 4: torch.int32}
BLOCK_IDS = torch.tensor([5, 2, 7, 0, 3], dtype=torch.int64)


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    bits = BITS[dtype.itemsize]
    info = torch.iinfo(bits)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=generator).view(dtype)


def _element_index(
    heads: int, block_size: int, head_dim: int, start: int, num_tokens: int
) -> torch.Tensor:
    """Flat cache index of each canonical [2, H, T, D] element, from the layout's definition:
    per (block, head), K as [D, bs] then V as [bs, D]."""
    tokens = torch.arange(start, start + num_tokens)
    block = BLOCK_IDS[tokens // block_size].view(1, -1, 1)
    offset = (tokens % block_size).view(1, -1, 1)
    head = torch.arange(heads).view(-1, 1, 1)
    dim = torch.arange(head_dim).view(1, 1, -1)
    base = (block * heads + head) * 2 * block_size * head_dim
    key = base + dim * block_size + offset
    value = base + block_size * head_dim + offset * head_dim + dim
    return torch.stack([key, value])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["small", "real"])
@pytest.mark.parametrize("start", [0, 13])
def test_gather_and_scatter_move_the_bits_the_layout_defines(
    copy_routine: str, dtype: torch.dtype, geometry: tuple[int, int, int], start: int
) -> None:
    heads, block_size, head_dim = geometry
    num_tokens = 3 * block_size + 5 - start  # partial first and last blocks when start > 0
    paged = layout.CpuBlockLayout.transposed_k(heads, block_size, head_dim, dtype)
    assert paged.is_transposed_k
    cache = _random_bits((8, heads, block_size, 2 * head_dim), dtype, seed=1)
    index = _element_index(heads, block_size, head_dim, start, num_tokens)
    bits = BITS[dtype.itemsize]

    gathered = paged.gather(cache, BLOCK_IDS, start, num_tokens)
    assert torch.equal(gathered.view(bits), cache.view(bits).view(-1)[index])

    # scatter from a token slice of a larger chunk, as the worker's load path passes it
    chunk = _random_bits((2, heads, num_tokens + 9, head_dim), dtype, seed=2)
    canonical = chunk[:, :, 4 : 4 + num_tokens]
    want = cache.view(bits).clone()
    want.view(-1)[index] = canonical.view(bits)
    paged.scatter(cache, BLOCK_IDS, start, canonical)
    assert torch.equal(cache.view(bits), want)  # and every other slot untouched


def test_kernel_and_fallback_agree_on_a_large_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    paged = layout.CpuBlockLayout.transposed_k(8, 128, 128, torch.bfloat16)
    cache = _random_bits((16, 8, 128, 256), torch.bfloat16, seed=3)
    ids = torch.tensor([11, 3, 14], dtype=torch.int64)
    by_kernel = paged.gather(cache, ids, 77, 300)
    monkeypatch.setattr(native, "kernel", None)
    by_torch = paged.gather(cache, ids, 77, 300)
    assert torch.equal(by_kernel.view(torch.int16), by_torch.view(torch.int16))
