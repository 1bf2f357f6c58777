"""Dtype conversion on read: a consumer gets a stored layer, head range or payload in the dtype
it runs in, as a view of the store's pages when nothing has to change."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.convert.dtype import (
    convert_pieces,
    convert_tensor,
    layer_in_place,
    layer_shape,
    read_layer,
    read_payload,
)
from kvfabric.convert.pieces import coalesce, kv_dtype, torch_dtype
from kvfabric.errors import PayloadSizeError, SpecError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVDtype, KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYERS, HEADS, TOKENS, DIM = 3, 4, 16, 32


def spec_for(dtype: torch.dtype) -> KVSpec:
    return KVSpec(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype=str(dtype).removeprefix("torch."),
        chunk_tokens=TOKENS,
    )


def kv(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A whole chunk [layers, 2, heads, tokens, dim] of random KV."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, HEADS, TOKENS, DIM, generator=generator).mul(3).to(dtype)


def open_store(path: Path, page_size: int) -> TieredStore:
    tier = TierConfig(TierKind.DRAM, 1 << 20, page_size=page_size)
    return TieredStore(StoreConfig(data_dir=str(path), tiers=(tier,)), maintenance=False)


def stored(store: TieredStore, data: torch.Tensor, first_token: int = 0):
    """Put ``data`` (a whole chunk) and pin it: the reader."""
    ns = Namespace("convert-test", spec_for(data.dtype))
    ref = chunk_hashes(ns, list(range(first_token, first_token + TOKENS)))[0]
    assert store.put(ns, ref.key, data.contiguous().view(torch.uint8).numpy(), parent=ref.parent)
    return store.get(ns, ref.key)


@pytest.fixture
def small_pages(tmp_path: Path):
    with open_store(tmp_path / "small", 4096) as store:  # a layer spans several pages
        yield store


@pytest.fixture
def big_pages(tmp_path: Path):
    with open_store(tmp_path / "big", 256 * 1024) as store:  # a chunk fits one page
        yield store


@pytest.mark.parametrize("stored_dtype", DTYPES)
@pytest.mark.parametrize("requested", DTYPES)
def test_every_layer_and_head_range_converts_like_torch(
    small_pages: TieredStore, stored_dtype: torch.dtype, requested: torch.dtype
) -> None:
    data = kv(stored_dtype)
    with stored(small_pages, data) as reader:
        for layer in range(LAYERS):
            got = read_layer(reader, layer, dtype=requested)
            assert got.dtype == requested and got.shape == (2, HEADS, TOKENS, DIM)
            assert torch.equal(got, data[layer].to(requested))
            for heads in [(0, 1), (1, 3), (2, 4), (0, HEADS)]:
                part = read_layer(reader, layer, heads=heads, dtype=requested)
                assert part.shape == layer_shape(reader.layout, heads)
                assert torch.equal(part, data[layer, :, heads[0] : heads[1]].to(requested))
        assert torch.equal(read_payload(reader, dtype=requested), data.to(requested))


def test_same_dtype_on_one_page_is_a_view_of_the_page(big_pages: TieredStore) -> None:
    data = kv(torch.bfloat16)
    with stored(big_pages, data) as reader:
        pieces = reader.layer_pieces(1)
        assert len(pieces) == 1
        got = read_layer(reader, 1)
        assert got.data_ptr() == pieces[0].ctypes.data  # zero copy
        assert torch.equal(got, data[1])
        whole = read_payload(reader, dtype="bf16")
        assert whole.data_ptr() == reader.pieces()[0].ctypes.data
        # a converted read is a copy, never an alias of the stored bytes
        assert read_layer(reader, 1, dtype=torch.float32).data_ptr() != got.data_ptr()


def test_adjacent_pages_of_one_arena_coalesce_into_one_view(small_pages: TieredStore) -> None:
    data = kv(torch.float16)
    with stored(small_pages, data) as reader:
        pieces = reader.layer_pieces(0)
        assert len(pieces) > 1  # the layer spans pages ...
        assert len(coalesce(pieces)) == 1  # ... which a fresh arena hands out in order
        got = read_layer(reader, 0)
        assert got.data_ptr() == pieces[0].ctypes.data
        assert torch.equal(got, data[0])


def test_a_head_range_is_two_runs_and_is_copied(big_pages: TieredStore) -> None:
    data = kv(torch.float32)
    with stored(big_pages, data) as reader:
        pieces = reader.layer_pieces(2, heads=(1, 2))
        assert len(coalesce(pieces)) == 2  # K and V runs are a plane apart
        got = read_layer(reader, 2, heads=(1, 2))
        assert got.data_ptr() not in {p.ctypes.data for p in pieces}
        assert torch.equal(got, data[2, :, 1:2])
        # every head: K and V runs are adjacent again
        assert (
            read_layer(reader, 2, heads=(0, HEADS)).data_ptr()
            == reader.layer_pieces(2)[0].ctypes.data
        )


def test_a_writers_layer_in_place_aliases_its_pages(big_pages: TieredStore) -> None:
    """A producer in the stored dtype fills the layer where it lies (no staging copy); in
    another dtype, or where the layer is not one run of memory, it is told to convert."""
    data = kv(torch.bfloat16, seed=3)
    ns = Namespace("in-place", spec_for(torch.bfloat16))
    ref = chunk_hashes(ns, list(range(TOKENS)))[0]
    writer = big_pages.reserve(ns, ref.key, parent=ref.parent)
    assert layer_in_place(writer, 0, torch.float16) is None
    for layer in range(LAYERS):
        target = layer_in_place(writer, layer, torch.bfloat16)
        assert target is not None and target.shape == (2, HEADS, TOKENS, DIM)
        target.copy_(data[layer])
        writer.commit_layer(layer)
    with big_pages.get(ns, ref.key) as reader:
        assert torch.equal(read_payload(reader), data)


@pytest.mark.parametrize("requested", DTYPES)
def test_out_is_filled_and_returned(small_pages: TieredStore, requested: torch.dtype) -> None:
    data = kv(torch.bfloat16, seed=5)
    with stored(small_pages, data) as reader:
        out = torch.full((2, 2, TOKENS, DIM), float("nan"), dtype=requested)
        assert read_layer(reader, 0, heads=(2, 4), dtype=requested, out=out) is out
        assert torch.equal(out, data[0, :, 2:4].to(requested))
        with pytest.raises(PayloadSizeError):
            read_layer(reader, 0, heads=(0, 1), dtype=requested, out=out)  # wrong shape
        with pytest.raises(SpecError):
            read_layer(
                reader,
                0,
                heads=(2, 4),
                dtype=torch.float16 if requested != torch.float16 else torch.float32,
                out=out,
            )  # wrong dtype
        with pytest.raises(ValueError, match="contiguous"):
            wide = torch.empty(2, 2, TOKENS, 2 * DIM, dtype=requested)[..., :DIM]
            read_layer(reader, 0, heads=(2, 4), dtype=requested, out=wide)


def test_unknown_dtypes_are_refused_with_the_known_ones_named() -> None:
    pieces = [np.zeros(16, dtype=np.uint8)]
    for bad in ("int8", "float64", torch.int32, torch.float64, 3):
        with pytest.raises(SpecError) as info:
            convert_pieces(pieces, "bfloat16", bad)
        assert "bfloat16" in str(info.value) or "float" in str(info.value)
        with pytest.raises(SpecError):
            convert_pieces(pieces, bad, "bfloat16")
    with pytest.raises(SpecError, match="fp8|scales"):
        convert_pieces(pieces, "fp8", "bfloat16")  # fp8 needs its scales


def test_dtype_names_in_every_form() -> None:
    assert kv_dtype("bf16") is KVDtype.BFLOAT16
    assert kv_dtype(torch.float16) is KVDtype.FLOAT16
    assert kv_dtype("torch.float32") is KVDtype.FLOAT32
    assert torch_dtype(KVDtype.FLOAT8_E4M3) == torch.float8_e4m3fn
    assert torch_dtype("half") == torch.float16


def test_wrong_sizes_are_refused() -> None:
    pieces = [np.zeros(64, dtype=np.uint8)]
    with pytest.raises(PayloadSizeError, match="shape"):
        convert_pieces(pieces, torch.bfloat16, torch.float32, (2, 2, 2, 5))  # 40 != 32
    with pytest.raises(PayloadSizeError, match="whole number"):
        convert_pieces([np.zeros(6, dtype=np.uint8)], torch.float32)  # 6 bytes, 4-byte items
    with pytest.raises(PayloadSizeError):
        convert_pieces(pieces, torch.float32, shape=(-4, -4))


def test_pieces_that_split_elements_still_convert() -> None:
    values = torch.arange(24, dtype=torch.float32)
    raw = values.view(torch.uint8).numpy().copy()
    pieces = [raw[0:3].copy(), raw[3:50].copy(), raw[50:96].copy()]  # separate buffers
    got = convert_pieces(pieces, "float32", "bfloat16", (2, 3, 4))
    assert torch.equal(got, values.view(2, 3, 4).to(torch.bfloat16))
    assert torch.equal(convert_pieces(pieces, "float32"), values)


def test_read_only_pieces_convert_without_warnings() -> None:
    values = torch.randn(2, 2, 3, 4).to(torch.float16)
    frozen = np.frombuffer(values.view(torch.uint8).numpy().tobytes(), dtype=np.uint8)
    assert not frozen.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(convert_pieces([frozen], "float16", shape=values.shape), values)
        assert torch.equal(
            convert_pieces([frozen[:16], frozen[16:]], "float16", "float32", values.shape),
            values.float(),
        )


def test_torch_pieces_of_one_pool_coalesce_and_convert() -> None:
    values = torch.randn(2, 3, 5, 4)
    pool = values.view(-1).view(torch.uint8)  # a device pool's bytes (cpu here)
    pieces = [pool[i : i + 32] for i in range(0, pool.numel(), 32)]
    got = convert_pieces(pieces, "float32", shape=values.shape)
    assert got.data_ptr() == pool.data_ptr() and torch.equal(got, values)
    as_half = convert_pieces(
        pieces[:1] + pieces[2:3] + pieces[1:2] + pieces[3:], "float32", "float16", values.shape
    )  # out of order: a copy
    reordered = torch.cat([pool[0:32], pool[64:96], pool[32:64], pool[96:]])
    assert torch.equal(as_half, reordered.view(torch.float32).view(values.shape).half())


def test_coalesce_merges_only_adjacent_views_of_one_buffer() -> None:
    buf = np.arange(100, dtype=np.uint8)
    other = np.arange(100, dtype=np.uint8)
    assert [p.tolist() for p in coalesce([buf[0:10], buf[10:30], buf[30:31]])] == [list(range(31))]
    assert len(coalesce([buf[0:10], buf[11:20]])) == 2  # a gap
    assert len(coalesce([buf[10:20], buf[0:10]])) == 2  # out of order
    assert len(coalesce([buf[0:10], other[10:20]])) == 2  # another buffer
    assert len(coalesce([buf[0:10], buf[10:10], buf[10:20]])) == 1  # empty pieces dropped
    assert coalesce([]) == []


def test_convert_tensor_is_identity_when_nothing_changes() -> None:
    x = torch.randn(2, 2, 4, 8).to(torch.bfloat16)
    assert convert_tensor(x, "bfloat16") is x
    assert torch.equal(convert_tensor(x, torch.float32), x.float())
    out = torch.empty(2, 2, 4, 8, dtype=torch.float16)
    assert convert_tensor(x, "float16", out=out) is out and torch.equal(out, x.half())
    with pytest.raises(SpecError):
        convert_tensor(x.to(torch.float64), "bfloat16")


@settings(max_examples=60, deadline=None)
@given(
    src=st.sampled_from(DTYPES),
    dst=st.sampled_from(DTYPES),
    shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(0, 5), st.integers(1, 6)),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    seed=st.integers(0, 2**31),
)
def test_any_split_into_pieces_converts_like_torch(
    src: torch.dtype, dst: torch.dtype, shape: tuple[int, ...], cuts: list[int], seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=generator) * 100).to(src)
    raw = values.view(-1).view(torch.uint8).numpy().copy()
    bounds = sorted({0, raw.nbytes, *(c % (raw.nbytes + 1) for c in cuts)})
    pieces = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    got = convert_pieces(pieces, src, dst, shape)
    assert got.dtype == dst and torch.equal(got, values.to(dst))


@pytest.mark.parametrize("requested", DTYPES)
@pytest.mark.parametrize("page_size", [4096, 256 * 1024])
def test_a_tensor_parallel_share_of_every_layer(
    tmp_path: Path, requested: torch.dtype, page_size: int
) -> None:
    data = kv(torch.bfloat16, seed=7)
    with open_store(tmp_path, page_size) as store:
        # objects put and deleted around it: its pages need not be adjacent or in order
        fillers = [
            stored(store, kv(torch.bfloat16, seed=8), first_token=1000 * (i + 1)) for i in range(3)
        ]
        for filler in fillers[::2]:
            filler.release()
            store.delete(filler.namespace, filler.key)
        with stored(store, data) as reader:
            for heads in [(0, 1), (1, 3), (0, HEADS)]:
                want = data[:, :, heads[0] : heads[1]].to(requested)
                got = read_payload(reader, heads=heads, dtype=requested)
                assert got.is_contiguous() and torch.equal(got, want)
                out = torch.empty_like(want)
                assert read_payload(reader, heads=heads, dtype=requested, out=out) is out
                assert torch.equal(out, want)
            with pytest.raises(SpecError):
                read_payload(reader, heads=(2, 1))
            with pytest.raises(PayloadSizeError):
                read_payload(
                    reader,
                    heads=(0, 2),
                    dtype=requested,
                    out=torch.empty(LAYERS, 2, 1, TOKENS, DIM, dtype=requested),
                )
