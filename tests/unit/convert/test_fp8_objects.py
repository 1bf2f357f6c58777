"""A namespace stored in fp8 (KVSpec dtype ``float8_e4m3fn``): producers write bf16 / fp16 /
fp32 layers through ``write_layer`` (quantized on the way in), consumers read them back in
their own dtype through ``read_layer`` / ``read_payload`` (dequantized), whole or by KV-head
range, within kvfabric.convert.fp8's error bound; the payload is the fp8 serialized form,
each head's scale in front of its values."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfabric.convert import fp8
from kvfabric.convert.dtype import layer_shape, read_layer, read_payload, write_layer
from kvfabric.convert.request import read_as, read_layer_as
from kvfabric.errors import PayloadSizeError, SpecError
from kvfabric.hashing import chunk_hashes
from kvfabric.readspec import ReadSpec
from kvfabric.spec import KVDtype, KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYERS, HEADS, TOKENS, DIM = 3, 4, 16, 32
SPEC = KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="fp8", chunk_tokens=TOKENS)
NS = Namespace("fp8-objects", SPEC)


def kv(dtype: torch.dtype, seed: int = 0, tokens: int = TOKENS) -> torch.Tensor:
    """A chunk [layers, 2, heads, tokens, dim] of KV with a magnitude per head."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.rand(LAYERS, 2, HEADS, 1, 1, generator=gen) * 8
    return (torch.randn(LAYERS, 2, HEADS, tokens, DIM, generator=gen) * magnitude).to(dtype)


def open_store(path: Path, page_size: int) -> TieredStore:
    tier = TierConfig(TierKind.DRAM, 1 << 20, page_size=page_size)
    return TieredStore(StoreConfig(data_dir=str(path), tiers=(tier,)), maintenance=False)


@pytest.fixture(params=[4096, 256 * 1024], ids=["layer-spans-pages", "chunk-in-one-page"])
def store(request, tmp_path: Path):
    with open_store(tmp_path, request.param) as opened:
        yield opened


def put(store: TieredStore, data: torch.Tensor, seed: int = 0):
    """Write ``data`` layer by layer through write_layer; the key."""
    ref = chunk_hashes(NS, list(range(seed * 1000, seed * 1000 + data.shape[3])))[0]
    with store.reserve(NS, ref.key, parent=ref.parent, num_tokens=ref.num_tokens) as writer:
        for layer in range(LAYERS):
            write_layer(writer, layer, data[layer])
        writer.commit()
    return ref.key


def expected(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the fp8 format gives back, by its definition (quantize, then dequantize)."""
    return torch.stack([fp8.dequantize(*fp8.quantize(layer), dtype=dtype) for layer in data])


def test_the_layout_counts_a_scale_per_head_and_leaves_other_dtypes_alone() -> None:
    layout = SPEC.layout(10)
    assert layout.head_bytes == 4 + 10 * DIM
    assert layout.nbytes == LAYERS * 2 * HEADS * (4 + 10 * DIM)
    bf16 = dataclasses.replace(SPEC, dtype="bfloat16")
    assert (
        layout.nbytes
        == fp8.chunk_nbytes(bf16, 10)
        == LAYERS * fp8.serialized_nbytes((2, HEADS, 10, DIM))
    )
    for dtype, itemsize in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        plain = dataclasses.replace(SPEC, dtype=dtype).layout(10)
        assert KVDtype.parse(dtype).scale_bytes == 0
        assert plain.head_bytes == 10 * DIM * itemsize
        assert plain.nbytes == LAYERS * 2 * HEADS * 10 * DIM * itemsize
    # heads [1, 3) of layer 2: one run per plane, records 1 and 2 of that plane
    record = 4 + 10 * DIM
    base = 2 * layout.layer_bytes
    assert layout.head_ranges(2, 1, 3) == [
        (base + record, 2 * record),
        (base + HEADS * record + record, 2 * record),
    ]
    assert fp8.bytes_saved(bf16) == bf16.chunk_bytes - SPEC.chunk_bytes


@pytest.mark.parametrize("source", DTYPES)
@pytest.mark.parametrize("requested", DTYPES)
def test_written_quantized_read_back_within_the_bound(
    store: TieredStore, source: torch.dtype, requested: torch.dtype
) -> None:
    data = kv(source)
    key = put(store, data)
    with store.get(NS, key) as reader:
        assert reader.nbytes == SPEC.chunk_bytes  # fp8 bytes are what the store holds
        whole = read_payload(reader, dtype=requested)
        assert whole.dtype == requested and whole.shape == (LAYERS, 2, HEADS, TOKENS, DIM)
        assert torch.equal(whole, expected(data, requested))
        for layer in range(LAYERS):
            got = read_layer(reader, layer, dtype=requested)
            assert torch.equal(got, whole[layer])
            x = data[layer]
            error = (got.double() - x.double()).abs()
            assert bool((error <= fp8.error_bound(x, fp8.compute_scales(x), requested)).all())
            assert not torch.equal(got, x.to(requested))  # it was quantized


def test_the_payload_is_the_serialized_form_with_each_heads_scale_in_front(
    store: TieredStore,
) -> None:
    data = kv(torch.bfloat16, seed=3)
    key = put(store, data)
    with store.get(NS, key) as reader:
        raw = np.frombuffer(reader.to_bytes(), dtype=np.uint8)
    for layer in range(LAYERS):
        one = raw[layer * SPEC.layout().layer_bytes : (layer + 1) * SPEC.layout().layer_bytes]
        assert torch.equal(torch.from_numpy(one.copy()), fp8.encode_layer(data[layer]))
        records = one.reshape(2, HEADS, 4 + TOKENS * DIM)
        scales = records[:, :, :4].copy().view("<f4").reshape(2, HEADS)
        assert torch.equal(torch.from_numpy(scales), fp8.compute_scales(data[layer]))


@pytest.mark.parametrize("heads", [(0, 1), (1, 3), (2, 4), (0, 4)])
def test_a_head_range_reads_only_its_heads_values_and_scales(
    store: TieredStore, heads: tuple[int, int]
) -> None:
    data = kv(torch.float16, seed=1)
    key = put(store, data)
    a, b = heads
    with store.get(NS, key) as reader:
        whole = read_payload(reader, dtype=torch.float32)
        for layer in range(LAYERS):
            pieces = reader.layer_pieces(layer, heads)
            assert sum(p.nbytes for p in pieces) == 2 * (b - a) * (4 + TOKENS * DIM)
            part = read_layer(reader, layer, heads=heads, dtype=torch.float32)
            assert torch.equal(part, whole[layer, :, a:b])
            # the same bytes decoded as a standalone [2, b - a, tokens, dim] layer
            joined = np.concatenate([np.asarray(p) for p in pieces])
            assert torch.equal(
                fp8.decode_layer(joined, layer_shape(reader.layout, heads), torch.float32), part
            )
        out = torch.empty(LAYERS, 2, b - a, TOKENS, DIM, dtype=torch.bfloat16)
        assert read_payload(reader, heads=heads, dtype=torch.bfloat16, out=out) is out
        assert torch.equal(out, whole[:, :, a:b].to(torch.bfloat16))


def test_head_range_writers_build_the_same_object_as_one_writer(tmp_path: Path) -> None:
    """Tensor-parallel ranks quantize their own heads (scales are per head): the object
    they build together is byte-identical to a single writer's."""
    data = kv(torch.bfloat16, seed=2)
    ref = chunk_hashes(NS, list(range(TOKENS)))[0]
    with open_store(tmp_path / "one", 4096) as one, open_store(tmp_path / "ranks", 4096) as ranks:
        put(one, data, seed=0)
        writers = [ranks.reserve(NS, ref.key, parent=ref.parent, heads=(h, h + 2)) for h in (0, 2)]
        for writer in writers:
            for layer in range(LAYERS):
                h = writer.heads[0]
                write_layer(writer, layer, data[layer, :, h : h + 2])
            writer.commit()
        with one.get(NS, ref.key) as a, ranks.get(NS, ref.key) as b:
            assert a.to_bytes() == b.to_bytes()


def test_non_finite_or_misshapen_input_is_refused_and_nothing_is_published(tmp_path: Path) -> None:
    data = kv(torch.bfloat16)
    ref = chunk_hashes(NS, list(range(TOKENS)))[0]
    with open_store(tmp_path, 4096) as store:
        for bad in (float("nan"), float("inf"), float("-inf")):
            poisoned = data[0].clone()
            poisoned[1, 2, 3, 4] = bad
            with store.reserve(NS, ref.key, parent=ref.parent) as writer:
                with pytest.raises(ValueError, match="non-finite"):
                    write_layer(writer, 0, poisoned)
            assert not store.contains(NS, ref.key)  # the writer aborted: nothing to read
        with store.reserve(NS, ref.key, parent=ref.parent) as writer:
            with pytest.raises(PayloadSizeError):
                write_layer(writer, 0, data[0, :, :, :8])  # fewer tokens than the object
            with pytest.raises(PayloadSizeError):
                write_layer(writer, 0, data[0, :, :3])  # three heads of four
            with pytest.raises(SpecError):
                write_layer(writer, 0, data[0].to(torch.float64))  # no such KV dtype
            with pytest.raises(TypeError):
                write_layer(writer, 0, data[0].numpy())  # type: ignore[arg-type]
            for layer in range(LAYERS):
                write_layer(writer, layer, data[layer])
            writer.commit()
        with store.get(NS, ref.key) as reader:
            with pytest.raises(SpecError, match="dtype="):
                read_layer(reader, 0)  # no plain fp8 tensor to hand out
            with pytest.raises(SpecError):
                read_layer(reader, 0, dtype="float8_e4m3fn")
            with pytest.raises(SpecError):
                read_payload(reader)
            with pytest.raises(PayloadSizeError):
                read_payload(
                    reader, dtype=torch.float32, out=torch.empty(LAYERS, 2, HEADS, TOKENS, DIM - 1)
                )
            with pytest.raises(PayloadSizeError):
                fp8.read_pieces(
                    reader.layer_pieces(0)[:-1] or [np.zeros(1, np.uint8)],
                    (2, HEADS, TOKENS, DIM),
                    torch.float32,
                )


def test_a_partial_chunk_and_an_mla_namespace(tmp_path: Path) -> None:
    mla = Namespace(
        "fp8-mla",
        KVSpec(
            num_layers=2,
            num_kv_heads=1,
            head_dim=72,
            dtype="float8_e4m3",
            kind="mla",
            chunk_tokens=TOKENS,
        ),
    )
    data = torch.randn(2, 1, 1, 5, 72, generator=torch.Generator().manual_seed(4))
    ref = chunk_hashes(mla, list(range(5)))[0]  # 5 tokens of a 16-token chunk
    with open_store(tmp_path, 4096) as store:
        with store.reserve(mla, ref.key, parent=ref.parent, num_tokens=5) as writer:
            assert writer.nbytes == 2 * (4 + 5 * 72)
            for layer in range(2):
                write_layer(writer, layer, data[layer])
            writer.commit()
        with store.get(mla, ref.key) as reader:
            assert torch.equal(
                read_payload(reader, dtype=torch.float32), expected(data, torch.float32)
            )


def test_write_layer_converts_into_plain_dtypes_too(tmp_path: Path) -> None:
    plain = Namespace("bf16-objects", dataclasses.replace(SPEC, dtype="bfloat16"))
    data = kv(torch.float32, seed=5)
    ref = chunk_hashes(plain, list(range(TOKENS)))[0]
    with open_store(tmp_path, 4096) as store:
        with store.reserve(plain, ref.key, parent=ref.parent) as writer:
            for layer in range(LAYERS):
                write_layer(writer, layer, data[layer])
            writer.commit()
        with store.get(plain, ref.key) as reader:
            assert torch.equal(read_payload(reader), data.to(torch.bfloat16))


def test_a_consumers_read_spec_names_its_dtype_heads_and_layout(tmp_path: Path) -> None:
    data = kv(torch.bfloat16, seed=6)
    with open_store(tmp_path, 4096) as store:
        key = put(store, data)
        with store.get(NS, key) as reader:
            whole = read_payload(reader, dtype=torch.float32)
            want = ReadSpec(dtype="float32", heads=(1, 3), layout="nhd")
            assert torch.equal(read_layer_as(reader, 2, want), whole[2, :, 1:3].transpose(1, 2))
            assert torch.equal(read_as(reader, ReadSpec(dtype="bf16")), whole.to(torch.bfloat16))
            with pytest.raises(SpecError):  # no plain fp8 tensor to hand out
                read_as(reader, ReadSpec(dtype="fp8"))
    with pytest.raises(SpecError, match="no conversion"):  # quantizing is the writer's job
        ReadSpec(dtype="fp8").check(dataclasses.replace(SPEC, dtype="bfloat16"))
