"""An SSD tier in fp8: chunks go down quantized (about half the bytes), come back up in the
namespace's dtype within kvfabric.convert.fp8's documented error bound, survive a restart,
and chunks of other dtypes stay native."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvfabric.convert import fp8
from kvfabric.errors import ConfigError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=32)
NS = Namespace("fp8-model", SPEC)
PAGE = 4096


def store_at(tmp_path: Path, fmt: str = "fp8") -> TieredStore:
    tiers = (
        TierConfig(TierKind.DRAM, 2 * SPEC.chunk_bytes, page_size=PAGE),
        TierConfig(
            TierKind.SSD, 64 * SPEC.chunk_bytes, path="ssd", segment_bytes=1 << 20, format=fmt
        ),
    )
    return TieredStore(StoreConfig(data_dir=str(tmp_path), tiers=tiers), maintenance=False)


def kv(seed: int, num_tokens: int) -> torch.Tensor:
    """Plausible KV: [layers, 2, heads, tokens, dim] bf16 with per-head magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(SPEC.num_layers, 2, SPEC.num_kv_heads, 1, 1, generator=gen) * 8
    values = (
        torch.randn(SPEC.num_layers, 2, SPEC.num_kv_heads, num_tokens, SPEC.head_dim, generator=gen)
        * scale
    )
    return values.to(torch.bfloat16)


def put_chain(store: TieredStore, tokens: int) -> list[tuple[bytes, torch.Tensor]]:
    out = []
    for i, ref in enumerate(chunk_hashes(NS, list(range(tokens)))):
        data = kv(i, ref.num_tokens)
        store.put(NS, ref.key, data, parent=ref.parent, num_tokens=ref.num_tokens)
        out.append((ref.key, data))
    return out


def read_back(store: TieredStore, key: bytes, num_tokens: int) -> torch.Tensor:
    with store.get(NS, key) as reader:
        raw = np.frombuffer(reader.to_bytes(), dtype=np.uint8).copy()
    return (
        torch.from_numpy(raw)
        .view(torch.bfloat16)
        .view(SPEC.num_layers, 2, SPEC.num_kv_heads, num_tokens, SPEC.head_dim)
    )


def assert_within_bound(original: torch.Tensor, got: torch.Tensor) -> None:
    for layer in range(SPEC.num_layers):
        x = original[layer]
        scales = fp8.compute_scales(x)
        error = (got[layer].double() - x.double()).abs()
        assert bool((error <= fp8.error_bound(x, scales, torch.bfloat16)).all())
        assert not torch.equal(got[layer], x) or bool((x == 0).all())  # it was quantized


def test_chunks_go_down_in_fp8_and_come_back_within_the_bound(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    chain = put_chain(store, 6 * SPEC.chunk_tokens - 7)  # the last chunk partial
    store.flush()
    on_ssd = [(k, d) for k, d in chain if store.tier_of(NS, k) == "ssd"]
    assert len(on_ssd) >= 3
    ssd = store.stats().tier("ssd")
    native = sum(SPEC.layout(d.shape[3]).nbytes for _, d in on_ssd)
    assert 0.45 * native < native - ssd.bytes_saved < 0.55 * native  # about half the bytes
    for key, data in on_ssd:
        assert_within_bound(data, read_back(store, key, data.shape[3]))  # promoted on read
        assert store.tier_of(NS, key) == "dram"
    store.close()


def test_an_fp8_copy_decodes_after_a_restart_whatever_the_format_is_then(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    chain = put_chain(store, 4 * SPEC.chunk_tokens)
    store.close()  # persist_on_close: everything goes down, in fp8
    store = store_at(tmp_path, fmt="native")
    assert len(store) == 4
    for key, data in chain:
        assert_within_bound(data, read_back(store, key, data.shape[3]))
    store.close()


def test_other_dtypes_and_native_tiers_stay_byte_exact(tmp_path: Path) -> None:
    store = store_at(tmp_path, fmt="native")
    chain = put_chain(store, 4 * SPEC.chunk_tokens)
    store.flush()
    assert store.stats().tier("ssd").bytes_saved == 0
    for key, data in chain:
        assert torch.equal(read_back(store, key, data.shape[3]), data)
    store.close()
    fp8_spec = KVSpec(
        num_layers=1, num_kv_heads=1, head_dim=16, dtype="float8_e4m3fn", chunk_tokens=8
    )
    ns = Namespace("already-fp8", fp8_spec)
    store = store_at(tmp_path / "fp8", fmt="fp8")
    refs = chunk_hashes(ns, list(range(64)))
    payloads = [
        np.random.default_rng(i).integers(0, 256, fp8_spec.chunk_bytes, np.uint8)
        for i in range(len(refs))
    ]
    for ref, data in zip(refs, payloads):
        store.put(ns, ref.key, data, parent=ref.parent)
    store.close()
    store = store_at(tmp_path / "fp8", fmt="fp8")
    for ref, data in zip(refs, payloads):
        with store.get(ns, ref.key) as reader:
            assert reader.to_bytes() == data.tobytes()  # not quantizable: kept as is
    store.close()


def test_the_format_is_validated() -> None:
    with pytest.raises(ConfigError, match="format"):
        TierConfig(TierKind.SSD, 1 << 20, format="fp4")
    with pytest.raises(ConfigError, match="unknown key"):
        TierConfig.from_dict({"kind": "dram", "capacity": "1MiB", "format": "fp8"})
