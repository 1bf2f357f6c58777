"""Tensor-parallel writes: R ranks write head ranges of one canonical object, S readers read
theirs; a layer is readable only once every head of it landed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfabric.errors import AlreadyExistsError, ObjectAbortedError, SpecError, SpecMismatchError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=3, num_kv_heads=4, head_dim=16, dtype="bfloat16", chunk_tokens=8)
NS = Namespace("tp-model", SPEC)
REF = chunk_hashes(NS, list(range(SPEC.chunk_tokens)))[0]


@pytest.fixture
def store(tmp_path: Path):
    config = StoreConfig(
        data_dir=str(tmp_path), tiers=(TierConfig(TierKind.DRAM, 1 << 20, page_size=4096),)
    )
    s = TieredStore(config, maintenance=False)
    yield s
    s.close()


def canonical() -> np.ndarray:
    """[layer][k|v][head][token*dim] bytes of the whole object."""
    data = np.random.default_rng(3).integers(0, 256, SPEC.chunk_bytes, dtype=np.uint8)
    return data.reshape(SPEC.num_layers, 2, SPEC.num_kv_heads, -1)


def ranges(parts: int) -> list[tuple[int, int]]:
    step = SPEC.num_kv_heads // parts
    return [(i * step, (i + 1) * step) for i in range(parts)]


@pytest.mark.parametrize("writers", [1, 2, 4])
@pytest.mark.parametrize("readers", [1, 2, 4])
def test_any_tp_split_reads_back_byte_exact(store: TieredStore, writers: int, readers: int) -> None:
    data = canonical()
    ranks = [store.reserve(NS, REF.key, parent=REF.parent, heads=h) for h in ranges(writers)]
    for layer in range(SPEC.num_layers):
        for rank, (start, end) in zip(ranks, ranges(writers)):
            rank.write_layer(layer, np.ascontiguousarray(data[layer, :, start:end]))
            rank.commit_layer(layer)
    with store.get(NS, REF.key) as reader:
        assert reader.complete
        assert reader.to_bytes() == data.tobytes()  # as if one rank had written it all
        for start, end in ranges(readers):
            for layer in range(SPEC.num_layers):
                got = b"".join(bytes(p) for p in reader.layer_pieces(layer, heads=(start, end)))
                assert got == data[layer, :, start:end].tobytes()


def test_a_layer_is_readable_only_once_every_rank_committed_it(store: TieredStore) -> None:
    data = canonical()
    low, high = (store.reserve(NS, REF.key, parent=REF.parent, heads=h) for h in ranges(2))
    reader = store.get(NS, REF.key)
    low.write_layer(0, np.ascontiguousarray(data[0, :, :2]))
    assert not low.commit_layer(0)
    assert not reader.ready(0)  # half of layer 0 would be a torn read
    high.write_layer(0, np.ascontiguousarray(data[0, :, 2:]))
    high.commit_layer(0)
    assert reader.ready(0) and not reader.ready(1)
    for layer in (1, 2):
        low.write_layer(layer, np.ascontiguousarray(data[layer, :, :2]))
    assert low.commit_layers(0b110)  # this rank is done: its lease ends
    assert low.closed and not reader.complete
    for layer in (1, 2):
        high.write_layer(layer, np.ascontiguousarray(data[layer, :, 2:]))
    assert high.commit_layers(0b110)
    assert reader.complete and reader.to_bytes() == data.tobytes()
    reader.release()
    assert store.stats().puts == 1


def test_ranges_must_not_overlap_or_mix_with_a_whole_object_writer(store: TieredStore) -> None:
    writer = store.reserve(NS, REF.key, parent=REF.parent, heads=(0, 2))
    with pytest.raises(AlreadyExistsError):
        store.reserve(NS, REF.key, parent=REF.parent, heads=(1, 3))
    with pytest.raises(AlreadyExistsError):
        store.reserve(NS, REF.key, parent=REF.parent)  # whole object
    with pytest.raises(SpecMismatchError):
        store.reserve(NS, REF.key, parent=REF.parent, heads=(2, 4), num_tokens=5)
    with pytest.raises(SpecError):
        store.reserve(NS, REF.key, parent=REF.parent, heads=(3, 9))
    with pytest.raises(ValueError, match="outside this writer's range"):
        writer.write_layer(0, np.zeros(4 * 2 * SPEC.layout().head_bytes, np.uint8), heads=(0, 4))
    with pytest.raises(ValueError, match="layer by layer"):
        writer.write(np.zeros(SPEC.chunk_bytes, np.uint8))
    writer.abort()
    whole = store.reserve(NS, REF.key, parent=REF.parent)  # the aborted object is gone
    with pytest.raises(AlreadyExistsError):
        store.reserve(NS, REF.key, parent=REF.parent, heads=(0, 2))
    whole.abort()


def test_one_rank_aborting_aborts_the_object_for_every_rank(store: TieredStore) -> None:
    low, high = (store.reserve(NS, REF.key, parent=REF.parent, heads=h) for h in ranges(2))
    reader = store.get(NS, REF.key)
    low.commit_layer(0)
    high.abort()
    assert not store.contains(NS, REF.key)
    with pytest.raises(ObjectAbortedError):
        low.commit_layer(1)
    with pytest.raises(ObjectAbortedError):
        reader.wait_layer(0, timeout=1)  # never a layer with a hole in it
    reader.release()
