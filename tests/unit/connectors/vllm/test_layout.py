"""Paged vLLM KV cache layer <-> canonical [2, H, T, D] conversion (connectors/vllm/layout.py)."""

from __future__ import annotations

import platform
from types import ModuleType

import pytest
import torch

from kvfabric_connectors.vllm import layout

H, BS, D = 2, 32, 64
NUM_BLOCKS = 9
DTYPE = torch.bfloat16


def _random(shape: tuple[int, ...], seed: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _cpu_cache(num_blocks: int = NUM_BLOCKS, seed: int = 0) -> torch.Tensor:
    return _random((num_blocks, H, BS, 2 * D), seed)


def _layouts() -> list[tuple[str, layout.PagedLayout, torch.Tensor]]:
    """(name, layout, a random cache of that layout) for every layout, fast paths and generic."""
    generator = torch.Generator().manual_seed(7)
    shuffled = torch.randperm(2 * H * BS * D, generator=generator)
    return [
        (
            "cuda-nhd",
            layout.CudaBlockLayout(H, BS, D, DTYPE),
            _random((2, NUM_BLOCKS, BS, H, D), 1),
        ),
        (
            "cuda-hnd",
            layout.CudaBlockLayout(H, BS, D, DTYPE, order="HND"),
            _random((2, NUM_BLOCKS, H, BS, D), 2),
        ),
        ("cpu-transposed-k", layout.CpuBlockLayout.transposed_k(H, BS, D, DTYPE), _cpu_cache()),
        ("cpu-permuted", layout.CpuBlockLayout(H, BS, D, DTYPE, perm=shuffled), _cpu_cache()),
    ]


LAYOUTS = _layouts()
LAYOUT_IDS = [name for name, _, _ in LAYOUTS]
# Non-contiguous, out of order, and not starting at block 0.
BLOCK_IDS = torch.tensor([5, 2, 7, 0, 3], dtype=torch.int64)
# (start, num_tokens): unaligned start and end spanning several blocks, aligned, one token.
RANGES = [(13, 100), (0, 160), (32, 64), (45, 1), (31, 2), (7, 0)]


@pytest.mark.parametrize(("name", "paged", "cache"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("start", "num_tokens"), RANGES)
def test_scatter_then_gather_round_trips_exactly(
    name: str, paged: layout.PagedLayout, cache: torch.Tensor, start: int, num_tokens: int
) -> None:
    kv_layer = cache.clone()
    canonical = _random((2, H, num_tokens, D), seed=start + num_tokens)
    paged.scatter(kv_layer, BLOCK_IDS, start, canonical)
    gathered = paged.gather(kv_layer, BLOCK_IDS, start, num_tokens)
    assert gathered.is_contiguous()
    assert gathered.shape == (2, H, num_tokens, D)
    assert torch.equal(gathered.view(torch.int16), canonical.view(torch.int16))


@pytest.mark.parametrize(("name", "paged", "cache"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("start", "num_tokens"), RANGES)
def test_scatter_leaves_every_other_slot_untouched(
    name: str, paged: layout.PagedLayout, cache: torch.Tensor, start: int, num_tokens: int
) -> None:
    # Restoring the tokens' old values must restore the whole cache: any slot outside the
    # range that scatter wrote would stay changed.
    kv_layer = cache.clone()
    before = paged.gather(kv_layer, BLOCK_IDS, start, num_tokens)
    paged.scatter(kv_layer, BLOCK_IDS, start, _random((2, H, num_tokens, D), seed=99))
    if num_tokens:
        assert not torch.equal(kv_layer, cache)
    paged.scatter(kv_layer, BLOCK_IDS, start, before)
    assert torch.equal(kv_layer.view(torch.int16), cache.view(torch.int16))


@pytest.mark.parametrize(("name", "paged", "cache"), LAYOUTS, ids=LAYOUT_IDS)
def test_gather_fills_the_given_out_tensor(
    name: str, paged: layout.PagedLayout, cache: torch.Tensor
) -> None:
    out = torch.empty((2, H, 50, D), dtype=DTYPE)
    assert paged.gather(cache, BLOCK_IDS, 20, 50, out=out) is out
    assert torch.equal(out, paged.gather(cache, BLOCK_IDS, 20, 50))


def _token_slot(start: int, index: int) -> tuple[int, int]:
    token = start + index
    return int(BLOCK_IDS[token // BS]), token % BS


def test_cuda_nhd_matches_hand_computed_reference() -> None:
    paged = layout.CudaBlockLayout(H, BS, D, DTYPE)
    kv = _random((2, NUM_BLOCKS, BS, H, D), 3)
    start, num_tokens = 27, 40
    gathered = paged.gather(kv, BLOCK_IDS, start, num_tokens)
    for i in range(num_tokens):
        block, offset = _token_slot(start, i)
        for head in range(H):
            assert torch.equal(gathered[0, head, i], kv[0, block, offset, head, :])
            assert torch.equal(gathered[1, head, i], kv[1, block, offset, head, :])


def test_cuda_hnd_matches_hand_computed_reference() -> None:
    paged = layout.CudaBlockLayout(H, BS, D, DTYPE, order="HND")
    kv = _random((2, NUM_BLOCKS, H, BS, D), 4)
    gathered = paged.gather(kv, BLOCK_IDS, 5, 33)
    for i in range(33):
        block, offset = _token_slot(5, i)
        for head in range(H):
            assert torch.equal(gathered[:, head, i], kv[:, block, head, offset, :])


def test_cuda_nhd_reads_a_cache_with_hnd_physical_strides() -> None:
    # vLLM allocates HND-ordered memory and hands connectors an NHD-shaped permuted view.
    physical = _random((2, NUM_BLOCKS, H, BS, D), 5)
    paged = layout.CudaBlockLayout(H, BS, D, DTYPE)
    nhd_view = physical.transpose(2, 3)
    reference = layout.CudaBlockLayout(H, BS, D, DTYPE, order="HND")
    assert torch.equal(
        paged.gather(nhd_view, BLOCK_IDS, 10, 70), reference.gather(physical, BLOCK_IDS, 10, 70)
    )


def test_cpu_transposed_k_matches_hand_computed_reference() -> None:
    # Per (block, head): K stored [D, bs] (element (t, d) at d * bs + t), then V [bs, D].
    paged = layout.CpuBlockLayout.transposed_k(H, BS, D, DTYPE)
    assert paged.is_transposed_k
    kv = _cpu_cache()
    per_head = kv.view(NUM_BLOCKS, H, 2 * BS * D)
    gathered = paged.gather(kv, BLOCK_IDS, 19, 30)
    for i in range(30):
        block, offset = _token_slot(19, i)
        for head in range(H):
            memory = per_head[block, head]
            assert torch.equal(gathered[0, head, i], memory[offset : BS * D : BS])
            start = BS * D + offset * D
            assert torch.equal(gathered[1, head, i], memory[start : start + D])


def test_cpu_permuted_layout_reads_elements_where_perm_says() -> None:
    perm = torch.randperm(2 * H * BS * D, generator=torch.Generator().manual_seed(11))
    paged = layout.CpuBlockLayout(H, BS, D, DTYPE, perm=perm)
    assert not paged.is_transposed_k
    kv = _cpu_cache()
    blocks = kv.view(NUM_BLOCKS, -1)
    gathered = paged.gather(kv, BLOCK_IDS, 40, 3)
    canonical_index = perm.view(2, H, BS, D)
    for i in range(3):
        block, offset = _token_slot(40, i)
        expected = blocks[block][canonical_index[:, :, offset, :]]
        assert torch.equal(gathered[:, :, i], expected)


def _permutation_kernel(perm: torch.Tensor) -> layout.WriteKernel:
    """A fake cache-write kernel placing canonical element c of a block at memory perm[c]."""

    def write(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_heads, block_size, head_dim = key_cache.shape[1:]
        memory = key_cache.as_strided((key_cache.shape[0], perm.numel()), (perm.numel(), 1))
        for token, slot in enumerate(slot_mapping.tolist()):
            block, offset = divmod(slot, block_size)
            canonical = perm.view(2, num_heads, block_size, head_dim)[:, :, offset, :]
            memory[block][canonical] = torch.stack([key[token], value[token]])

    return write


@pytest.mark.parametrize(("heads", "block_size", "head_dim"), [(2, 32, 64), (3, 128, 128)])
def test_probe_recovers_a_kernels_permutation_exactly(
    heads: int, block_size: int, head_dim: int
) -> None:
    # (3, 128, 128) has 98304 elements per block: three base-256 digits.
    perm = torch.randperm(
        2 * heads * block_size * head_dim, generator=torch.Generator().manual_seed(3)
    )
    probed = layout.probe_cpu_layout(_permutation_kernel(perm), heads, block_size, head_dim, DTYPE)
    assert torch.equal(probed.perm, perm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_probe_of_a_transposed_k_kernel_takes_the_fast_path(dtype: torch.dtype) -> None:
    closed_form = layout.CpuBlockLayout.transposed_k(H, BS, D, dtype)
    probed = layout.probe_cpu_layout(_permutation_kernel(closed_form.perm), H, BS, D, dtype)
    assert probed.is_transposed_k


def test_probe_rejects_a_kernel_that_skips_elements() -> None:
    def skip_last_token(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache[0, :, :-1] = key[:-1].transpose(0, 1)
        value_cache[0] = value.transpose(0, 1)

    with pytest.raises(ValueError, match="unwritten"):
        layout.probe_cpu_layout(skip_last_token, H, BS, D, DTYPE)


def test_probe_rejects_a_kernel_that_duplicates_elements() -> None:
    def write_k_twice(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache[0] = key.transpose(0, 1)
        value_cache[0] = key.transpose(0, 1)

    with pytest.raises(ValueError, match="exactly once"):
        layout.probe_cpu_layout(write_k_twice, H, BS, D, DTYPE)


def test_probe_rejects_dtypes_that_cannot_carry_digits() -> None:
    with pytest.raises(ValueError, match="cannot probe"):
        layout.probe_cpu_layout(_permutation_kernel(torch.arange(1)), H, BS, D, torch.int8)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "paged", "cache"), LAYOUTS, ids=LAYOUT_IDS)
def test_cache_of_wrong_shape_or_dtype_is_rejected(
    name: str, paged: layout.PagedLayout, cache: torch.Tensor
) -> None:
    with pytest.raises(ValueError, match="must be"):
        paged.gather(cache[..., :-1], BLOCK_IDS, 0, 1)
    with pytest.raises(ValueError, match="dtype"):
        paged.gather(cache.float(), BLOCK_IDS, 0, 1)
    with pytest.raises(ValueError, match="must be"):
        paged.scatter(cache.clone()[None], BLOCK_IDS, 0, torch.zeros((2, H, 1, D), dtype=DTYPE))


@pytest.mark.parametrize(("name", "paged", "cache"), LAYOUTS, ids=LAYOUT_IDS)
def test_bad_block_ids_and_ranges_are_rejected(
    name: str, paged: layout.PagedLayout, cache: torch.Tensor
) -> None:
    with pytest.raises(ValueError, match="int64"):
        paged.gather(cache, BLOCK_IDS.int(), 0, 1)
    with pytest.raises(ValueError, match="1-D"):
        paged.gather(cache, BLOCK_IDS.view(1, -1), 0, 1)
    with pytest.raises(ValueError, match="need 5 block ids"):
        paged.gather(cache, BLOCK_IDS[:4], 100, 30)
    with pytest.raises(ValueError, match=r"not in \[0, 9\)"):
        paged.gather(cache, torch.tensor([0, NUM_BLOCKS]), 20, 20)
    with pytest.raises(ValueError, match=r"not in \[0, 9\)"):
        paged.gather(cache, torch.tensor([-1]), 0, 1)
    with pytest.raises(ValueError, match="start"):
        paged.gather(cache, BLOCK_IDS, -1, 1)
    with pytest.raises(ValueError, match="num_tokens"):
        paged.gather(cache, BLOCK_IDS, 0, -2)
    with pytest.raises(TypeError, match="block_ids"):
        paged.gather(cache, [0, 1], 0, 1)


@pytest.mark.parametrize(("name", "paged", "cache"), LAYOUTS, ids=LAYOUT_IDS)
def test_bad_out_and_canonical_are_rejected(
    name: str, paged: layout.PagedLayout, cache: torch.Tensor
) -> None:
    with pytest.raises(ValueError, match="shape"):
        paged.gather(cache, BLOCK_IDS, 0, 4, out=torch.empty((2, H, 5, D), dtype=DTYPE))
    with pytest.raises(ValueError, match="dtype"):
        paged.gather(cache, BLOCK_IDS, 0, 4, out=torch.empty((2, H, 4, D)))
    with pytest.raises(ValueError, match="contiguous"):
        paged.gather(cache, BLOCK_IDS, 0, 4, out=torch.empty((2, H, D, 4), dtype=DTYPE).mT)
    with pytest.raises(ValueError, match="shape"):
        paged.scatter(cache, BLOCK_IDS, 0, torch.zeros((2, H + 1, 4, D), dtype=DTYPE))
    with pytest.raises(ValueError, match=r"\[2, H, T, D\]"):
        paged.scatter(cache, BLOCK_IDS, 0, torch.zeros((2, H, D), dtype=DTYPE))
    with pytest.raises(ValueError, match="dtype"):
        paged.scatter(cache, BLOCK_IDS, 0, torch.zeros((2, H, 4, D), dtype=torch.float16))


def test_bad_geometry_and_perm_are_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        layout.CudaBlockLayout(H, 0, D, DTYPE)
    with pytest.raises(ValueError, match="order"):
        layout.CudaBlockLayout(H, BS, D, DTYPE, order="NDH")
    with pytest.raises(TypeError, match="dtype"):
        layout.CudaBlockLayout(H, BS, D, "bfloat16")
    with pytest.raises(ValueError, match="shape"):
        layout.CpuBlockLayout(H, BS, D, DTYPE, perm=torch.arange(10))
    with pytest.raises(ValueError, match="not a permutation"):
        layout.CpuBlockLayout(H, BS, D, DTYPE, perm=torch.zeros(2 * H * BS * D, dtype=torch.int64))


def test_cpu_cache_must_be_contiguous() -> None:
    paged = layout.CpuBlockLayout.transposed_k(H, BS, D, DTYPE)
    every_other_block = _cpu_cache(2 * NUM_BLOCKS)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        paged.gather(every_other_block, BLOCK_IDS, 0, 1)


# --- layout_for_vllm_cache -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "order"), [((2, NUM_BLOCKS, BS, H, D), "NHD"), ((2, NUM_BLOCKS, H, BS, D), "HND")]
)
def test_layout_for_a_cuda_cache_follows_its_shape(shape: tuple[int, ...], order: str) -> None:
    chosen = layout.layout_for_vllm_cache(
        torch.empty(shape, dtype=DTYPE),
        block_size=BS,
        num_kv_heads=H,
        head_dim=D,
        device_type="cuda",
        isa=None,
    )
    assert isinstance(chosen, layout.CudaBlockLayout)
    assert chosen.order == order
    assert (chosen.block_size, chosen.num_kv_heads, chosen.head_dim, chosen.dtype) == (
        BS,
        H,
        D,
        DTYPE,
    )


@pytest.mark.parametrize(
    ("device_type", "shape"),
    [
        ("cuda", (2, NUM_BLOCKS, BS, H, D + 1)),
        ("cuda", (NUM_BLOCKS, H, BS, 2 * D)),
        ("cpu", (2, NUM_BLOCKS, BS, H, D)),
        ("cpu", (NUM_BLOCKS, H, BS, D)),
        ("xpu", (2, NUM_BLOCKS, BS, H, D)),
    ],
)
def test_layout_for_an_unrecognised_cache_is_an_error(
    device_type: str, shape: tuple[int, ...]
) -> None:
    with pytest.raises(ValueError, match="must be|unsupported device_type"):
        layout.layout_for_vllm_cache(
            torch.empty(shape, dtype=DTYPE),
            block_size=BS,
            num_kv_heads=H,
            head_dim=D,
            device_type=device_type,
            isa="vec",
        )


# --- against vLLM's real CPU cache-write kernel ------------------------------------------


@pytest.fixture(scope="module")
def vllm_cpu_attn() -> ModuleType:
    return pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


x86_only = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="the vec ISA is x86's"
)


def _write_with_real_kernel(
    isa: str, kv_layer: torch.Tensor, block_ids: torch.Tensor, start: int, num_tokens: int
) -> torch.Tensor:
    """Write random K/V for tokens [start, start + num_tokens) of a request through vLLM's
    kernel, in shuffled order, as do_kv_cache_update does; return them canonical."""
    num_blocks, heads, block_size, _ = kv_layer.shape
    canonical = _random((2, heads, num_tokens, D), start + num_tokens, kv_layer.dtype)
    tokens = torch.arange(start, start + num_tokens)
    slots = block_ids[tokens // block_size] * block_size + tokens % block_size
    order = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(start))
    cache = kv_layer.view(num_blocks, heads, 2 * block_size, D)
    key_cache, value_cache = cache.chunk(2, dim=2)
    key, value = (half.transpose(0, 1)[order].contiguous() for half in canonical)
    layout.vllm_cpu_write_kernel(isa)(key, value, key_cache, value_cache, slots[order])
    return canonical


@x86_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_real_vec_kernel_probes_to_the_closed_form_transposed_k(
    vllm_cpu_attn: ModuleType, dtype: torch.dtype
) -> None:
    probed = layout.probe_cpu_layout(layout.vllm_cpu_write_kernel("vec"), H, BS, D, dtype)
    assert torch.equal(probed.perm, layout.CpuBlockLayout.transposed_k(H, BS, D, dtype).perm)
    assert probed.is_transposed_k


@pytest.mark.parametrize("block_size", [BS, 128])
def test_real_kernel_of_this_machine(vllm_cpu_attn: ModuleType, block_size: int) -> None:
    # The ISA vLLM picks here: "vec" (AVX-512 without AMX) stores K transposed, as
    # ENVIRONMENT.md says; other ISAs ("amx" packs K and V in pairs) must still probe to a
    # layout whose gather returns exactly what the kernel wrote.
    isa = vllm_cpu_attn._get_attn_isa(DTYPE, block_size, D)
    probed = layout.probe_cpu_layout(layout.vllm_cpu_write_kernel(isa), H, block_size, D, DTYPE)
    if isa == "vec":
        assert probed.is_transposed_k
    kv_layer = torch.zeros((4, H, block_size, 2 * D), dtype=DTYPE)
    ids = torch.tensor([3, 1, 0, 2])
    start, num_tokens = block_size // 2 + 3, 2 * block_size
    written = _write_with_real_kernel(isa, kv_layer, ids, start, num_tokens)
    assert torch.equal(probed.gather(kv_layer, ids, start, num_tokens), written)


@pytest.mark.parametrize("isa", ["detected", pytest.param("vec", marks=x86_only)])
def test_probed_layout_gathers_what_the_real_kernel_wrote(
    vllm_cpu_attn: ModuleType, isa: str
) -> None:
    if isa == "detected":
        isa = vllm_cpu_attn._get_attn_isa(DTYPE, BS, D)
    kv_layer = _cpu_cache()
    paged = layout.layout_for_vllm_cache(
        kv_layer, block_size=BS, num_kv_heads=H, head_dim=D, device_type="cpu", isa=isa
    )
    assert isinstance(paged, layout.CpuBlockLayout)
    for start, num_tokens in [(13, 100), (0, 160), (77, 1)]:
        written = _write_with_real_kernel(isa, kv_layer, BLOCK_IDS, start, num_tokens)
        assert torch.equal(paged.gather(kv_layer, BLOCK_IDS, start, num_tokens), written)


def test_scatter_is_what_the_real_kernel_would_write(vllm_cpu_attn: ModuleType) -> None:
    isa = vllm_cpu_attn._get_attn_isa(DTYPE, BS, D)
    paged = layout.layout_for_vllm_cache(
        _cpu_cache(), block_size=BS, num_kv_heads=H, head_dim=D, device_type="cpu", isa=None
    )
    by_kernel, by_scatter = _cpu_cache(seed=5), _cpu_cache(seed=5)
    written = _write_with_real_kernel(isa, by_kernel, BLOCK_IDS, 45, 90)
    paged.scatter(by_scatter, BLOCK_IDS, 45, written)
    assert torch.equal(by_scatter.view(torch.int16), by_kernel.view(torch.int16))


def _sliced_canonical(num_tokens: int, seed: int) -> torch.Tensor:
    """Canonical K/V as the worker passes them: a token slice of a larger chunk (strided)."""
    return _random((2, H, num_tokens + 9, D), seed)[:, :, 4 : 4 + num_tokens]


def test_probe_attaches_a_kernel_that_writes_strided_input_where_perm_says() -> None:
    perm = torch.randperm(2 * H * BS * D, generator=torch.Generator().manual_seed(5))
    probed = layout.probe_cpu_layout(_permutation_kernel(perm), H, BS, D, DTYPE)
    assert probed.write_kernel is not None
    generic = layout.CpuBlockLayout(H, BS, D, DTYPE, perm=perm)
    for start, num_tokens in RANGES:
        by_kernel, by_index = _cpu_cache(seed=3), _cpu_cache(seed=3)
        canonical = _sliced_canonical(num_tokens, start)
        probed.scatter(by_kernel, BLOCK_IDS, start, canonical)
        generic.scatter(by_index, BLOCK_IDS, start, canonical)
        assert torch.equal(by_kernel.view(torch.int16), by_index.view(torch.int16))


def test_probe_does_not_attach_a_kernel_that_ignores_strides() -> None:
    perm = torch.randperm(2 * H * BS * D, generator=torch.Generator().manual_seed(6))
    placing = _permutation_kernel(perm)

    def contiguous_only(key, value, key_cache, value_cache, slot_mapping) -> None:
        # reads its input as if it were contiguous, as a kernel ignoring strides would
        flat_k = key.as_strided(key.shape, (key.shape[1] * key.shape[2], key.shape[2], 1))
        flat_v = value.as_strided(value.shape, (value.shape[1] * value.shape[2], value.shape[2], 1))
        placing(flat_k, flat_v, key_cache, value_cache, slot_mapping)

    probed = layout.probe_cpu_layout(contiguous_only, H, BS, D, DTYPE)
    assert torch.equal(probed.perm, perm)  # the probe's own input is contiguous
    assert probed.write_kernel is None


def test_transposed_k_layout_keeps_its_strided_views() -> None:
    closed_form = layout.CpuBlockLayout.transposed_k(H, BS, D, DTYPE)
    probed = layout.probe_cpu_layout(_permutation_kernel(closed_form.perm), H, BS, D, DTYPE)
    assert probed.is_transposed_k and probed.write_kernel is None


@pytest.mark.parametrize("block_size", [BS, 128])
def test_scatter_of_a_token_slice_is_byte_exact_against_the_real_kernel(
    vllm_cpu_attn: ModuleType, block_size: int
) -> None:
    """The scatter the worker's load path makes (token slices of a chunk, unaligned ranges,
    out-of-order blocks) writes exactly what vLLM's own kernel writes for those tokens, both
    when scatter goes through the kernel (this machine's ISA unless it is "vec") and not."""
    isa = vllm_cpu_attn._get_attn_isa(DTYPE, block_size, D)
    probed = layout.probe_cpu_layout(layout.vllm_cpu_write_kernel(isa), H, block_size, D, DTYPE)
    assert (probed.write_kernel is None) == probed.is_transposed_k
    generic = layout.CpuBlockLayout(H, block_size, D, DTYPE, perm=probed.perm)
    ids = torch.tensor([3, 1, 0, 2])
    for start, num_tokens in [
        (block_size // 2 + 3, 2 * block_size),
        (0, 4 * block_size),
        (block_size - 1, 2),
        (5, 1),
    ]:
        reference = torch.zeros((4, H, block_size, 2 * D), dtype=DTYPE)
        canonical = _write_with_real_kernel(isa, reference, ids, start, num_tokens)
        strided = torch.zeros((2, H, num_tokens + 7, D), dtype=DTYPE)
        strided[:, :, 3 : 3 + num_tokens] = canonical
        for paged in (probed, generic):
            written = torch.zeros_like(reference)
            paged.scatter(written, ids, start, strided[:, :, 3 : 3 + num_tokens])
            assert torch.equal(written.view(torch.int16), reference.view(torch.int16))
