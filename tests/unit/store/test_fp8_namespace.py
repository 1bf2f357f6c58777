"""A namespace stored in fp8 at put time on an SSD tier in fp8: the codec leaves its chunks
as they are (they already are fp8), so they go down and come back byte for byte, cost the
same bytes on every tier, and count no savings; a bf16 namespace beside it is quantized."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvfabric.convert import fp8
from kvfabric.convert.dtype import read_payload, write_layer
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore, codec
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float8_e4m3fn", chunk_tokens=32)
NS = Namespace("fp8-at-put", SPEC)
BF16 = Namespace("fp8-at-put", dataclasses.replace(SPEC, dtype="bfloat16"))


def store_at(tmp_path: Path) -> TieredStore:
    tiers = (
        TierConfig(TierKind.DRAM, 2 * BF16.spec.chunk_bytes, page_size=4096),
        TierConfig(
            TierKind.SSD,
            64 * BF16.spec.chunk_bytes,
            path="ssd",
            segment_bytes=1 << 20,
            format="fp8",
        ),
    )
    return TieredStore(StoreConfig(data_dir=str(tmp_path), tiers=tiers), maintenance=False)


def kv(seed: int, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 2, 2, tokens, 64, generator=gen) * 4).to(torch.bfloat16)


def test_the_codec_leaves_an_fp8_namespace_as_it_is() -> None:
    assert not codec.encodable(SPEC)
    assert codec.encodable(BF16.spec)
    assert codec.encoded_nbytes(BF16.spec, 7) == SPEC.layout(7).nbytes  # one format


def test_fp8_chunks_go_to_ssd_and_back_byte_for_byte(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    chain = []
    for i, ref in enumerate(chunk_hashes(NS, list(range(6 * 32 - 5)))):
        with store.reserve(NS, ref.key, parent=ref.parent, num_tokens=ref.num_tokens) as w:
            data = kv(i, ref.num_tokens)
            for layer in range(3):
                write_layer(w, layer, data[layer])
            w.commit()
        with store.get(NS, ref.key) as reader:
            chain.append((ref.key, reader.to_bytes(), data))
    store.flush()
    on_ssd = [item for item in chain if store.tier_of(NS, item[0]) == "ssd"]
    assert len(on_ssd) >= 3
    assert store.stats().tier("ssd").bytes_saved == 0  # nothing left to save
    for key, stored, data in on_ssd:
        with store.get(NS, key) as reader:  # promoted back into DRAM
            assert reader.to_bytes() == stored
            got = read_payload(reader, dtype=torch.float32)
        assert store.tier_of(NS, key) == "dram"
        for layer in range(3):
            x = data[layer]
            error = (got[layer].double() - x.double()).abs()
            assert bool((error <= fp8.error_bound(x, fp8.compute_scales(x))).all())
    store.close()


def test_an_ssd_copy_of_a_bf16_chunk_is_the_fp8_namespace_payload(tmp_path: Path) -> None:
    """The SSD tier's encoding of a bf16 chunk and the fp8 namespace's put of the same KV
    are the same bytes: one serialized form."""
    data = kv(9, 32)
    pieces = [data.contiguous().view(-1).view(torch.uint8).numpy()]
    encoded = codec.encode(BF16.spec, 32, pieces)
    ref = chunk_hashes(NS, list(range(32)))[0]
    with store_at(tmp_path) as store:
        with store.reserve(NS, ref.key, parent=ref.parent) as writer:
            for layer in range(3):
                write_layer(writer, layer, data[layer])
            writer.commit()
        with store.get(NS, ref.key) as reader:
            assert reader.to_bytes() == encoded.tobytes()
