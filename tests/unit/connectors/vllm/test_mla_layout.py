"""vLLM MLA cache layer <-> canonical [1, 1, T, latent_dim] conversion
(connectors/vllm/mla_layout.py), checked by hand and against vLLM's own MLA cache writers:
``torch.ops._C.concat_and_cache_mla_cpu`` (the CPU build's op; the AMX MLA backend writes
through it) and the CPU reference MLA backend's ``do_kv_cache_update`` (what the engine on
a host without AMX runs). The CUDA op ``concat_and_cache_mla`` is not in the CPU build."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfabric_connectors.vllm.layout import PagedLayout
from kvfabric_connectors.vllm.mla_layout import MlaBlockLayout, mla_layout_for_vllm_cache

BS, RANK, ROPE = 16, 512, 64
LATENT = RANK + ROPE
NUM_BLOCKS = 7
DTYPE = torch.bfloat16
BLOCK_IDS = torch.tensor([5, 2, 6, 0, 3], dtype=torch.int64)  # deliberately out of order
RANGES = [(0, 5 * BS), (5, 40), (BS - 1, 2), (3 * BS, BS), (37, 1), (9, 0)]

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _random(shape: tuple[int, ...], seed: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _caches(seed: int, dtype: torch.dtype = DTYPE) -> dict[str, torch.Tensor]:
    """The same random cache content in every form vLLM may hand a connector."""
    rows = _random((NUM_BLOCKS, BS, LATENT), seed, dtype)
    padded = torch.zeros((NUM_BLOCKS, BS, LATENT + 64), dtype=dtype)
    padded[..., :LATENT] = rows
    return {
        "3d": rows.clone(),  # vLLM's MLA backends before 0.32: [blocks, tokens, latent]
        "4d": rows.clone().unsqueeze(1),  # vLLM 0.32: [blocks, heads=1, tokens, latent]
        # the same logical shape with the strides of vLLM's LBNHC order (heads inside tokens)
        "4d-lbnhc": rows.clone().unsqueeze(2).transpose(1, 2),
        "padded-rows": padded[..., :LATENT],  # rows further apart than latent_dim
    }


def _slots(block_ids: torch.Tensor, start: int, num_tokens: int) -> torch.Tensor:
    tokens = torch.arange(start, start + num_tokens)
    return block_ids[tokens // BS] * BS + tokens % BS


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[nb * bs, latent] rows of the cache, by hand: row ``slot`` is a token's latent."""
    return cache.reshape(NUM_BLOCKS * BS, LATENT)


@pytest.mark.parametrize("form", list(_caches(0)))
def test_gather_reads_each_tokens_slot_row(form: str) -> None:
    cache = _caches(0)[form]
    layout = mla_layout_for_vllm_cache(cache, block_size=BS, latent_dim=LATENT)
    for start, num_tokens in RANGES:
        got = layout.gather(cache, BLOCK_IDS, start, num_tokens)
        assert got.shape == (1, 1, num_tokens, LATENT)
        want = _rows(cache)[_slots(BLOCK_IDS, start, num_tokens)]
        assert torch.equal(got[0, 0], want)


@pytest.mark.parametrize("form", list(_caches(0)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scatter_then_gather_round_trips_and_leaves_other_slots(
    form: str, dtype: torch.dtype
) -> None:
    cache = _caches(1, dtype)[form]
    layout = MlaBlockLayout(BS, LATENT, dtype)
    for start, num_tokens in RANGES:
        before = cache.clone()
        canonical = _random((1, 1, num_tokens, LATENT), start + 100, dtype)
        layout.scatter(cache, BLOCK_IDS, start, canonical)
        assert torch.equal(layout.gather(cache, BLOCK_IDS, start, num_tokens), canonical)
        written = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool)
        written[_slots(BLOCK_IDS, start, num_tokens)] = True
        assert torch.equal(_rows(cache)[~written], _rows(before)[~written])


def test_scatter_takes_a_strided_token_slice_of_a_chunk() -> None:
    """The worker's load path scatters a token slice of a chunk read from the fabric."""
    cache = _caches(2)["4d"]
    layout = MlaBlockLayout(BS, LATENT, DTYPE)
    chunk = _random((1, 1, 60, LATENT), 3)
    layout.scatter(cache, BLOCK_IDS, 21, chunk[:, :, 7:52])
    assert torch.equal(layout.gather(cache, BLOCK_IDS, 21, 45), chunk[:, :, 7:52])


def test_gather_fills_the_given_out_tensor() -> None:
    cache = _caches(3)["4d"]
    layout = MlaBlockLayout(BS, LATENT, DTYPE)
    out = torch.empty((1, 1, 40, LATENT), dtype=DTYPE)
    assert layout.gather(cache, BLOCK_IDS, 5, 40, out=out) is out
    assert torch.equal(out[0, 0], _rows(cache)[_slots(BLOCK_IDS, 5, 40)])


def test_it_is_a_paged_layout_of_one_plane_and_one_head() -> None:
    layout = MlaBlockLayout(BS, LATENT, DTYPE)
    assert isinstance(layout, PagedLayout)
    assert (layout.planes, layout.num_kv_heads, layout.latent_dim) == (1, 1, LATENT)


@pytest.mark.parametrize(
    "shape",
    [
        (NUM_BLOCKS, BS, LATENT + 1),  # another latent size
        (NUM_BLOCKS, 2 * BS, LATENT),  # another block size
        (NUM_BLOCKS, 2, BS, LATENT),  # two "heads": not an MLA cache
        (2, NUM_BLOCKS, BS, 1, LATENT),  # a flash-attention K/V cache
        (NUM_BLOCKS, 1, BS, 2 * LATENT),  # vLLM's CPU K/V cache of one head
    ],
)
def test_caches_of_another_shape_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="MLA cache layer"):
        mla_layout_for_vllm_cache(torch.zeros(shape, dtype=DTYPE), block_size=BS, latent_dim=LATENT)


def test_bad_dtype_canonical_and_ranges_are_refused() -> None:
    cache = _caches(4)["4d"]
    layout = MlaBlockLayout(BS, LATENT, DTYPE)
    with pytest.raises(ValueError, match="dtype"):
        layout.gather(cache.float(), BLOCK_IDS, 0, 4)
    with pytest.raises(ValueError, match=r"\[1, 1, 4, 576\]"):  # K and V planes: not MLA
        layout.scatter(cache, BLOCK_IDS, 0, torch.zeros((2, 1, 4, LATENT), dtype=DTYPE))
    with pytest.raises(ValueError, match="block ids"):
        layout.gather(cache, BLOCK_IDS, 4 * BS, 2 * BS)
    with pytest.raises(ValueError, match="not in"):
        layout.gather(cache, torch.tensor([NUM_BLOCKS]), 0, 1)


# --- against vLLM's own MLA cache writers ----------------------------------------------------


def _op_writer() -> Writer:
    """torch.ops._C.concat_and_cache_mla_cpu, as the AMX MLA backend calls it."""
    cpu = pytest.importorskip("vllm.platforms.cpu")
    # vLLM's own choice of its kernel library for this CPU (vllm._C needs AVX-512 BF16: on a
    # host without it, importing it dies of an illegal instruction)
    cpu.CpuPlatform.import_kernels()
    op = getattr(torch.ops._C, "concat_and_cache_mla_cpu", None)
    if op is None:
        pytest.skip("this vLLM build has no concat_and_cache_mla_cpu")

    def write(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
        # the op takes the cache only as [num_blocks, block_size, latent] (a view here)
        op(kv_c, k_pe, cache[:, 0] if cache.dim() == 4 else cache, slots)

    return write


def _reference_backend_writer() -> Writer:
    """The CPU reference MLA backend's do_kv_cache_update (it uses nothing of its instance)."""
    cpu_mla = pytest.importorskip("vllm.v1.attention.backends.mla.cpu_mla")

    def write(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
        scale = torch.ones(1)
        cpu_mla.CPUMLAImpl.do_kv_cache_update(
            None, kv_c, k_pe[:, None], cache, slots, "auto", scale
        )

    return write


WRITERS = {"concat_and_cache_mla_cpu": _op_writer, "cpu_mla_backend": _reference_backend_writer}


def _write_with_vllm(
    writer: Writer, cache: torch.Tensor, block_ids: torch.Tensor, start: int, num_tokens: int
) -> torch.Tensor:
    """Write random latents (kv_c, k_pe) of tokens [start, start + num_tokens) of a request
    with vLLM's writer, in shuffled order; return them as the canonical [1, 1, T, latent]."""
    kv_c = _random((num_tokens, RANK), start)
    k_pe = _random((num_tokens, ROPE), start + 1)
    order = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(start))
    writer(kv_c[order], k_pe[order], cache, _slots(block_ids, start, num_tokens)[order])
    return torch.cat([kv_c, k_pe], dim=-1)[None, None]


@pytest.fixture(params=list(WRITERS))
def vllm_writer(request: pytest.FixtureRequest) -> Writer:
    return WRITERS[request.param]()


def test_gather_returns_exactly_what_vllm_wrote(vllm_writer: Writer) -> None:
    cache = torch.zeros((NUM_BLOCKS, 1, BS, LATENT), dtype=DTYPE)  # as vLLM 0.32 allocates it
    layout = mla_layout_for_vllm_cache(cache, block_size=BS, latent_dim=LATENT)
    for start, num_tokens in [(5, 40), (0, 5 * BS), (BS - 1, 2), (37, 1)]:
        written = _write_with_vllm(vllm_writer, cache, BLOCK_IDS, start, num_tokens)
        assert torch.equal(layout.gather(cache, BLOCK_IDS, start, num_tokens), written)


def test_scatter_writes_exactly_what_vllm_would(vllm_writer: Writer) -> None:
    by_vllm = _random((NUM_BLOCKS, 1, BS, LATENT), 9)  # other requests' data around
    by_scatter = by_vllm.clone()
    layout = MlaBlockLayout(BS, LATENT, DTYPE)
    for start, num_tokens in [(21, 45), (0, BS), (BS - 1, 2)]:
        written = _write_with_vllm(vllm_writer, by_vllm, BLOCK_IDS, start, num_tokens)
        layout.scatter(by_scatter, BLOCK_IDS, start, written)
        assert torch.equal(by_scatter.view(torch.int16), by_vllm.view(torch.int16))


def test_negative_control_a_wrong_offset_or_block_order_does_not_match(
    vllm_writer: Writer,
) -> None:
    """The comparisons above can fail: the same check with a token offset off by one, or
    the request's blocks in another order, or the latent halves swapped, rejects the data."""
    cache = torch.zeros((NUM_BLOCKS, 1, BS, LATENT), dtype=DTYPE)
    layout = MlaBlockLayout(BS, LATENT, DTYPE)
    start, num_tokens = 5, 40
    written = _write_with_vllm(vllm_writer, cache, BLOCK_IDS, start, num_tokens)
    assert torch.equal(layout.gather(cache, BLOCK_IDS, start, num_tokens), written)
    assert not torch.equal(layout.gather(cache, BLOCK_IDS, start + 1, num_tokens), written)
    shuffled = BLOCK_IDS[[1, 0, 2, 3, 4]]
    assert not torch.equal(layout.gather(cache, shuffled, start, num_tokens), written)
    swapped = torch.cat([written[..., RANK:], written[..., :RANK]], dim=-1)
    assert not torch.equal(layout.gather(cache, BLOCK_IDS, start, num_tokens), swapped)
