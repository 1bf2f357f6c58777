"""TieredStore: the behaviour a producer, a consumer and an operator rely on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from stream_recorder import StreamRecorder

from kvfabric.errors import (
    AlreadyExistsError,
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    LeaseExpiredError,
    NotFoundError,
    ObjectAbortedError,
    PayloadSizeError,
    SpecError,
    SpecMismatchError,
)
from kvfabric.hashing import ROOT, chunk_hashes, chunk_keys
from kvfabric.memory import native
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("tiny", SPEC)
CHUNK = SPEC.chunk_bytes  # 32 KiB
PAGE = 4096


def payload(key: bytes, nbytes: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, nbytes, dtype=np.uint8
    )


def make_store(tmp_path: Path, *tiers: TierConfig, **policy: object) -> TieredStore:
    tiers = tiers or (TierConfig(TierKind.DRAM, 16 * CHUNK, page_size=PAGE),)
    config = StoreConfig(data_dir=str(tmp_path), tiers=tuple(tiers), **policy)  # type: ignore
    return TieredStore(config, maintenance=False)


def put_chain(store: TieredStore, ns: Namespace, n_chunks: int, start: int = 0) -> list[bytes]:
    tokens = list(range(start, start + n_chunks * ns.spec.chunk_tokens))
    refs = chunk_hashes(ns, tokens)
    for ref in refs:
        store.put(ns, ref.key, payload(ref.key), parent=ref.parent)
    return [r.key for r in refs]


def read(store: TieredStore, ns: Namespace, key: bytes) -> bytes:
    with store.get(ns, key) as reader:
        return reader.to_bytes()


@pytest.fixture
def store(tmp_path: Path):
    s = make_store(tmp_path)
    yield s
    s.close()


def test_put_get_round_trip_is_byte_exact(store: TieredStore) -> None:
    keys = put_chain(store, NS, 3)
    for key in keys:
        assert read(store, NS, key) == payload(key).tobytes()
    assert store.stats().puts == 3 and store.stats().gets == 3


@pytest.mark.skipif(native.kernel is None, reason="the C kernel was not built")
def test_a_get_is_copied_through_the_cache_and_a_put_of_a_whole_object_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's ``read_into`` fills the engine's buffers, which its next forward pass
    reads: never stored non-temporally. A put of an object of :data:`STREAM_MIN_BYTES` and
    more is not read back at once: it streams (the threshold each copy asked the kernel for)."""
    ns = Namespace("big", KVSpec(4, 8, 128, "bfloat16", chunk_tokens=128))  # 2 MiB objects
    store = make_store(tmp_path, TierConfig(TierKind.DRAM, 2 * ns.spec.chunk_bytes))
    recorder = StreamRecorder(native.kernel)
    monkeypatch.setattr(native, "kernel", recorder)
    (ref,) = chunk_hashes(ns, list(range(ns.spec.chunk_tokens)))
    key, data = ref.key, payload(ref.key, ns.spec.chunk_bytes)
    assert store.put(ns, key, data)
    out = np.empty(ns.spec.chunk_bytes, np.uint8)
    with store.get(ns, key) as reader:
        reader.read_into(out)
    store.close()
    assert np.array_equal(out, data)
    put_min, get_min = recorder.stream_min
    assert put_min <= ns.spec.chunk_bytes < get_min


def test_reader_pieces_are_zero_copy_views_of_the_arena(store: TieredStore) -> None:
    (key,) = put_chain(store, NS, 1)
    arena = store._state.tiers[0].arena.array  # type: ignore[union-attr]
    with store.get(NS, key) as reader:
        assert all(np.shares_memory(piece, arena) for piece in reader.pieces())


def test_head_range_read_returns_only_that_range(store: TieredStore) -> None:
    (key,) = put_chain(store, NS, 1)
    data = payload(key)
    layout = SPEC.layout()
    canonical = data.reshape(SPEC.num_layers, 2, SPEC.num_kv_heads, -1)  # [L][k|v][head][tok*dim]
    arena = store._state.tiers[0].arena.array  # type: ignore[union-attr]
    with store.get(NS, key) as reader:
        pieces = reader.layer_pieces(2, heads=(1, 3))
        assert sum(p.nbytes for p in pieces) == 2 * 2 * layout.head_bytes
        # the range is read in place: views of the arena, nothing of the rest copied
        assert all(np.shares_memory(piece, arena) for piece in pieces)
        got = np.concatenate(pieces).reshape(2, 2, -1)
        assert np.array_equal(got, canonical[2, :, 1:3])
        out = np.empty(2 * 2 * layout.head_bytes, dtype=np.uint8)
        reader.read_into(out, layer=2, heads=(1, 3))
        assert np.array_equal(out.reshape(2, 2, -1), canonical[2, :, 1:3])


def test_layer_streaming_reader_waits_for_each_layer(store: TieredStore) -> None:
    key = chunk_keys(NS, list(range(16)))[0]
    data = payload(key).reshape(SPEC.num_layers, -1)
    writer = store.reserve(NS, key)
    reader = store.get(NS, key)  # a reader can pin an object still being written
    assert not reader.ready(0)
    with pytest.raises(ValueError, match="not committed"):
        reader.layer_pieces(0)
    seen: list[int] = []

    def produce() -> None:
        for layer in range(SPEC.num_layers):
            time.sleep(0.05)
            writer.write_layer(layer, data[layer])
            writer.commit_layer(layer)

    thread = threading.Thread(target=produce)
    thread.start()
    for layer in range(SPEC.num_layers):
        reader.wait_layer(layer, timeout=10)
        seen.append(layer)
        # layer i is readable while later layers may not be committed yet
        assert np.array_equal(np.concatenate(reader.layer_pieces(layer)), data[layer])
    thread.join()
    assert reader.complete
    reader.release()
    assert seen == [0, 1, 2, 3]


def test_wait_layer_times_out_and_sees_aborts(store: TieredStore) -> None:
    key = chunk_keys(NS, list(range(16)))[0]
    writer = store.reserve(NS, key)
    reader = store.get(NS, key)
    with pytest.raises(DeadlineExceededError):
        reader.wait_layer(1, timeout=0.05)
    writer.abort()
    with pytest.raises(ObjectAbortedError):
        reader.wait_layer(1, timeout=1)
    reader.release()
    assert not store.contains(NS, key)
    assert store._state.tiers[0].used_bytes == 0  # type: ignore[union-attr]


def test_writer_context_without_commit_aborts(store: TieredStore) -> None:
    key = chunk_keys(NS, list(range(16)))[0]
    with store.reserve(NS, key) as writer:
        writer.write_layer(0, payload(key)[: SPEC.layout().layer_bytes])
        writer.commit_layer(0)
    assert not store.contains(NS, key)
    assert store.stats().aborted_writes == 1


def test_lookup_is_longest_prefix_with_tokens_per_tier(store: TieredStore) -> None:
    keys = put_chain(store, NS, 5)
    result = store.lookup(NS, keys + chunk_keys(NS, list(range(200)))[5:8])
    assert (result.matched_chunks, result.matched_tokens) == (5, 80)
    assert result.tier_tokens == {"dram": 80}
    store.delete(NS, keys[2])
    assert store.lookup(NS, keys).matched_chunks == 2  # never past a missing parent
    stats = store.stats()
    assert stats.lookups == 2 and stats.hit_tokens == 80 + 32
    assert stats.miss_tokens == 3 * 16 + 3 * 16
    assert stats.tier("dram").hit_tokens == 112


def test_lookup_tokens_hashes_the_prompt(store: TieredStore) -> None:
    put_chain(store, NS, 3)
    assert store.lookup_tokens(NS, list(range(48 + 5))).matched_tokens == 48


def test_tenants_never_see_each_other(store: TieredStore) -> None:
    tenant_a = Namespace("tiny", SPEC, tenant_salt="a")
    tenant_b = Namespace("tiny", SPEC, tenant_salt="b")
    keys = put_chain(store, tenant_a, 2)
    assert store.lookup(tenant_b, keys).matched_chunks == 0  # even with the raw keys
    assert not store.contains(tenant_b, keys[0])
    with pytest.raises(NotFoundError):
        store.get(tenant_b, keys[0])
    assert not store.delete(tenant_b, keys[0])
    assert read(store, tenant_a, keys[0]) == payload(keys[0]).tobytes()
    assert store.lookup(tenant_a, keys).matched_chunks == 2
    stats = store.stats()
    assert {(n.tenant, n.lookups, n.hit_tokens) for n in stats.namespaces} == {("a", 1, 32)}


def test_spec_mismatch_is_a_clear_error(store: TieredStore) -> None:
    (key,) = put_chain(store, NS, 1)
    other = Namespace("tiny", KVSpec(**(SPEC.to_dict() | {"dtype": "float16"})))
    with pytest.raises(SpecMismatchError, match="stored with spec"):
        store.get(other, key)


def test_bad_input_leaves_the_store_intact(store: TieredStore) -> None:
    keys = put_chain(store, NS, 2)
    with pytest.raises(PayloadSizeError, match=f"must be {CHUNK} bytes"):
        store.put(NS, b"k" * 16, np.zeros(100, np.uint8))
    with pytest.raises(SpecError, match="16 bytes"):
        store.put(NS, b"short", payload(keys[0]))
    with pytest.raises(SpecError, match="num_tokens"):
        store.reserve(NS, b"x" * 16, num_tokens=17)
    with pytest.raises(NotFoundError):
        store.get(NS, b"\x00" * 16)
    with pytest.raises(AlreadyExistsError):
        store.reserve(NS, keys[0])
    assert store.put(NS, keys[0], payload(keys[0])) is False
    with store.get(NS, keys[1]) as reader, pytest.raises(PayloadSizeError):
        reader.read_into(np.zeros(10, np.uint8))
    assert not store.contains(NS, b"k" * 16)
    assert [read(store, NS, k) for k in keys] == [payload(k).tobytes() for k in keys]
    assert store._state.tiers[0].used_bytes == 2 * CHUNK  # type: ignore[union-attr]


def test_partial_last_chunk_is_its_own_object(store: TieredStore) -> None:
    refs = chunk_hashes(NS, list(range(16 + 5)))
    tail = refs[-1]
    nbytes = SPEC.layout(tail.num_tokens).nbytes
    store.put(
        NS, tail.key, payload(tail.key, nbytes), parent=tail.parent, num_tokens=tail.num_tokens
    )
    with store.get(NS, tail.key) as reader:
        assert reader.num_tokens == 5 and reader.to_bytes() == payload(tail.key, nbytes).tobytes()


def test_prefix_aware_eviction_takes_leaves_first_and_counts(tmp_path: Path) -> None:
    store = make_store(tmp_path, TierConfig(TierKind.DRAM, 6 * CHUNK, page_size=PAGE))
    old = put_chain(store, NS, 3)  # a chain of 3: only its tail is a leaf
    hot = put_chain(store, NS, 3, start=1000)
    read(store, NS, hot[-1])  # the other chain's leaf is recently used
    put_chain(store, NS, 2, start=5000)
    # the cold chain shrank from its tail; its root survived longer than its leaf
    assert store.lookup(NS, old).matched_chunks == 1
    assert store.stats().tier("dram").evictions == 2
    assert store.lookup(NS, hot).matched_chunks == 3
    store.close()


def test_pinned_objects_are_never_evicted(tmp_path: Path) -> None:
    store = make_store(tmp_path, TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=PAGE))
    a, b = put_chain(store, NS, 1), put_chain(store, NS, 1, start=100)
    readers = [store.get(NS, a[0]), store.get(NS, b[0])]
    with pytest.raises(CapacityError, match="pinned"):
        put_chain(store, NS, 1, start=200)
    for r in readers:
        r.release()
    put_chain(store, NS, 1, start=200)
    assert store.stats().tier("dram").evictions == 1
    store.close()


def test_demotion_through_every_tier_and_promotion_on_hit(tmp_path: Path) -> None:
    store = make_store(
        tmp_path,
        TierConfig(TierKind.DEVICE, 2 * CHUNK, page_size=PAGE, device="cpu"),
        TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.CXL, 2 * CHUNK, page_size=PAGE, numa_node=0),
        TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
    )
    keys = put_chain(store, NS, 8)
    store.flush()
    store.maintain()
    where = {store.tier_of(NS, k) for k in keys}
    assert where == {"device", "dram", "cxl", "ssd"}
    stats = store.stats()
    assert stats.objects == 8 and stats.evictions == 0
    assert stats.tier("device").demotions >= 6 and stats.tier("ssd").objects >= 2
    first = next(k for k in keys if store.tier_of(NS, k) == "ssd")
    assert read(store, NS, first) == payload(first).tobytes()  # checksum-verified read-back
    assert store.tier_of(NS, first) == "device"  # promoted on hit
    assert store.stats().tier("ssd").promotions == 1
    for key in keys:
        assert read(store, NS, key) == payload(key).tobytes()
    store.close()


def test_a_full_middle_tier_sends_victims_further_down_not_away(tmp_path: Path) -> None:
    store = make_store(
        tmp_path,
        TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.CXL, 2 * CHUNK, page_size=PAGE, numa_node=0),
        TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
        promote_on_hit=False,
    )
    first = [put_chain(store, NS, 1, start=100 * i)[0] for i in range(4)]
    assert {store.tier_of(NS, k) for k in first[:2]} == {"cxl"}
    readers = [store.get(NS, k) for k in first[:2]]  # cxl: nothing there can move
    put_chain(store, NS, 1, start=1000)  # a dram victim cannot go to cxl: it goes to SSD
    store.flush()
    assert store.stats().evictions == 0
    assert "ssd" in {store.tier_of(NS, k) for k in first[2:]}
    for reader in readers:
        reader.release()
    for key in first:
        assert read(store, NS, key) == payload(key).tobytes()
    store.close()


def test_ssd_contents_survive_a_restart(tmp_path: Path) -> None:
    tiers = (
        TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
    )
    store = make_store(tmp_path, *tiers, persist_on_close=False)
    keys = put_chain(store, NS, 6)
    store.flush()
    on_ssd = [k for k in keys if store.tier_of(NS, k) == "ssd"]
    assert len(on_ssd) == 4
    store.close()
    store = make_store(tmp_path, *tiers, persist_on_close=False)
    assert len(store) == len(on_ssd)  # re-indexed from the segment headers; DRAM was volatile
    leading = next((i for i, k in enumerate(keys) if k not in on_ssd), len(keys))
    assert store.lookup(NS, keys).matched_chunks == leading
    for key in on_ssd:
        assert read(store, NS, key) == payload(key).tobytes()
    store.close()


def test_close_persists_memory_resident_objects(tmp_path: Path) -> None:
    tiers = (
        TierConfig(TierKind.DRAM, 4 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.CXL, 2 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
    )
    store = make_store(tmp_path, *tiers)  # persist_on_close is the default
    keys = put_chain(store, NS, 8)
    reader = store.get(NS, keys[0])
    reader.release()
    store.close()
    store = make_store(tmp_path, *tiers)
    assert len(store) == 8 and store.lookup(NS, keys).matched_chunks == 8  # nothing lost
    assert {store.tier_of(NS, k) for k in keys} == {"ssd"}
    for key in keys:
        assert read(store, NS, key) == payload(key).tobytes()
    store.close()


def test_corrupt_ssd_record_is_never_served(tmp_path: Path) -> None:
    tiers = (
        TierConfig(TierKind.DRAM, 1 * CHUNK, page_size=PAGE),
        TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
    )
    store = make_store(tmp_path, *tiers)
    keys = put_chain(store, NS, 2)
    store.flush()
    assert store.tier_of(NS, keys[0]) == "ssd"
    extent = store._state.index.find(store._namespaces[NS.seed], keys[0]).handle  # type: ignore[union-attr]
    segment = next((tmp_path / "ssd").glob("seg-*.kvf"))
    with open(segment, "r+b") as f:
        f.seek(extent.payload_offset + 100)
        byte = f.read(1)
        f.seek(extent.payload_offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(NotFoundError, match="corrupt"):
        read(store, NS, keys[0])
    assert not store.contains(NS, keys[0])
    assert store.stats().tier("ssd").corrupt_records == 1
    assert read(store, NS, keys[1]) == payload(keys[1]).tobytes()
    store.close()


def test_hostile_ssd_path_is_refused(tmp_path: Path) -> None:
    for hostile in ("../escape", "/etc", "a/../../b"):
        with pytest.raises(ConfigError):
            make_store(
                tmp_path / "data",
                TierConfig(TierKind.DRAM, CHUNK, page_size=PAGE),
                TierConfig(TierKind.SSD, 1 << 20, path=hostile),
            )
    assert not (tmp_path / "escape").exists() and not (tmp_path / "b").exists()


def test_expired_reservation_is_reclaimed_and_late_commit_fails(tmp_path: Path) -> None:
    """The object is aborted at the deadline, but its pages stay quarantined until the
    writer lets go of them (it may still be writing): only then are they free."""
    store = make_store(tmp_path, reservation_timeout_s=0.05)
    key = chunk_keys(NS, list(range(16)))[0]
    writer = store.reserve(NS, key)
    time.sleep(0.1)
    store.maintain()
    assert not store.contains(NS, key) and store.stats().expired_leases == 1
    assert store._state.tiers[0].used_bytes == CHUNK  # type: ignore[union-attr]
    with pytest.raises(LeaseExpiredError):
        writer.commit()
    writer.close()
    assert store._state.tiers[0].used_bytes == 0  # type: ignore[union-attr]
    store.close()


def test_each_committed_layer_renews_the_reservation(tmp_path: Path) -> None:
    """A writer streaming a forward pass that lasts longer than ``reservation_timeout_s``
    keeps its lease while it commits layers (a 4,096-token prefill of an 8-layer model took
    over 30 s on a 2-core CPU engine: the connector dropped every save of that step). One
    layer later than the timeout after the previous one still expires it."""
    store = make_store(tmp_path, reservation_timeout_s=0.3)
    key, late = chunk_keys(NS, list(range(32)))
    writer = store.reserve(NS, key)
    for layer in range(SPEC.num_layers):  # 0.2 s a layer: the whole object takes longer
        time.sleep(0.2)
        store.maintain()
        assert not writer.expired, f"expired before layer {layer}"
        writer.commit_layer(layer)
    assert store.contains(NS, key)
    stalled = store.reserve(NS, late)
    stalled.commit_layer(0)
    time.sleep(0.4)  # no progress for longer than the timeout
    store.maintain()
    with pytest.raises(LeaseExpiredError):
        stalled.commit_layer(1)
    stalled.close()
    store.close()


def test_a_writer_frozen_past_its_deadline_never_writes_into_another_objects_pages(
    tmp_path: Path,
) -> None:
    """Regression: on the old code an expired reservation's pages were freed at the deadline
    and handed to the next object while the frozen writer still held views of them; when it
    resumed, its bytes landed in the other object (1 of 16 chunks served wrong)."""
    store = make_store(
        tmp_path, TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=PAGE), reservation_timeout_s=0.05
    )
    frozen_key, *others = chunk_keys(NS, list(range(16 * 8)))
    frozen = store.reserve(NS, frozen_key)
    views = frozen.layer_pieces(0)  # taken before it froze
    time.sleep(0.1)
    store.maintain()  # the deadline passes while it is frozen
    stored = []
    for key in others:  # the memory is wanted: each put that fits goes in
        try:
            assert store.put(NS, key, payload(key))
            stored.append(key)
        except CapacityError:
            pass
    assert stored
    for view in views:  # the writer wakes up and finishes its copy
        view[:] = 0xEE
    for key in stored:
        if store.contains(NS, key):
            with store.get(NS, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
    with pytest.raises(LeaseExpiredError):
        frozen.commit()
    frozen.close()  # now its pages may be reused
    assert store._state.tiers[0].used_bytes <= 2 * CHUNK  # type: ignore[union-attr]
    store.close()


def test_expired_pin_stops_protecting_the_object(tmp_path: Path) -> None:
    store = make_store(tmp_path, TierConfig(TierKind.DRAM, 1 * CHUNK, page_size=PAGE))
    (key,) = put_chain(store, NS, 1)
    reader = store.pin(NS, key, lease_s=0.05)
    time.sleep(0.1)
    put_chain(store, NS, 1, start=100)  # needs the memory: the stale pin is reclaimed
    with pytest.raises(LeaseExpiredError):
        reader.to_bytes()
    assert not store.contains(NS, key)
    store.close()


def test_delete_while_pinned_frees_on_release(store: TieredStore) -> None:
    (key,) = put_chain(store, NS, 1)
    reader = store.get(NS, key)
    assert store.delete(NS, key)
    assert not store.contains(NS, key)
    assert reader.to_bytes() == payload(key).tobytes()  # the pin keeps the bytes valid
    assert store._state.tiers[0].used_bytes == CHUNK  # type: ignore[union-attr]
    reader.release()
    assert store._state.tiers[0].used_bytes == 0  # type: ignore[union-attr]


def test_background_maintenance_keeps_memory_under_the_high_watermark(tmp_path: Path) -> None:
    config = StoreConfig(
        data_dir=str(tmp_path),
        high_watermark=0.5,
        low_watermark=0.25,
        maintenance_interval_s=0.02,
        tiers=(
            TierConfig(TierKind.DRAM, 8 * CHUNK, page_size=PAGE),
            TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd"),
        ),
    )
    with TieredStore(config) as store:
        put_chain(store, NS, 6)
        deadline = time.monotonic() + 10
        while store._state.tiers[0].used_bytes > 2 * CHUNK and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store._state.tiers[0].used_bytes <= 2 * CHUNK
        assert store.stats().tier("ssd").objects >= 4


def test_root_parent_default(store: TieredStore) -> None:
    key = b"r" * 16
    store.put(NS, key, payload(key))
    assert store._state.index.find(store._namespaces[NS.seed], key).parent == ROOT  # type: ignore[union-attr]


def test_admin_evict_drops_leaves_first_and_counts(tmp_path: Path) -> None:
    store = make_store(tmp_path, TierConfig(TierKind.DRAM, 8 * CHUNK, page_size=PAGE))
    keys = put_chain(store, NS, 4)
    reader = store.get(NS, keys[0])  # pinned root: evicting it would be refused anyway
    assert store.evict(nbytes=2 * CHUNK) == 2
    assert store.lookup(NS, keys).matched_chunks == 2  # tail went first
    assert store.evict() == 1  # the pinned root stays
    assert store.contains(NS, keys[0])
    reader.release()
    assert store.stats().tier("dram").evictions == 3
    with pytest.raises(NotFoundError, match="no tier"):
        store.evict(tier="tape")
    store.close()


def test_lookups_of_unknown_namespaces_create_no_state(store: TieredStore) -> None:
    for i in range(50):
        made_up = Namespace(f"nobody-{i}", SPEC)
        result = store.lookup(made_up, chunk_keys(made_up, list(range(32))))
        assert result.matched_chunks == 0 and result.miss_tokens == 32
    assert store._namespaces == {} and store.stats().namespaces == ()
    assert store.stats().miss_tokens == 50 * 32
