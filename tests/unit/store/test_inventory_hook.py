"""TieredStore inventory listeners: every change of the set of complete objects is reported.

A *mirror* built only from the listener's reports must equal :meth:`TieredStore.inventory`
after any sequence of puts, moves and removals: that is what the global index relies on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfabric.errors import NotFoundError
from kvfabric.hashing import ROOT, chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.store.protocol import RemovedObject, StoredObject
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("tiny", SPEC)
CHUNK = SPEC.chunk_bytes
PAGE = 4096
DRAM_SSD = (
    TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=PAGE),
    TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
)


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, CHUNK, dtype=np.uint8
    )


def make_store(tmp_path: Path, *tiers: TierConfig, **policy: object) -> TieredStore:
    tiers = tiers or (TierConfig(TierKind.DRAM, 16 * CHUNK, page_size=PAGE),)
    config = StoreConfig(data_dir=str(tmp_path), tiers=tuple(tiers), **policy)  # type: ignore
    return TieredStore(config, maintenance=False)


def put_chain(store: TieredStore, n_chunks: int, start: int = 0) -> list[bytes]:
    refs = chunk_hashes(NS, list(range(start, start + n_chunks * SPEC.chunk_tokens)))
    for ref in refs:
        assert store.put(NS, ref.key, payload(ref.key), parent=ref.parent)
    return [r.key for r in refs]


class Mirror:
    """Applies listener reports; ``calls`` keeps them for assertions on their shape."""

    def __init__(self) -> None:
        self.held: dict[bytes, set[str]] = {}
        self.calls: list[tuple[list[StoredObject], list[RemovedObject]]] = []

    def __call__(self, stored: list[StoredObject], removed: list[RemovedObject]) -> None:
        self.calls.append((stored, removed))
        for ns, key, _parent, _num_tokens, tier, _tokens in stored:
            assert ns.seed == NS.seed
            self.held.setdefault(key, set()).add(tier)
        for _ns, key, tier in removed:
            tiers = self.held.get(key, set())
            assert tier in tiers, f"removal of {key.hex()} from {tier} never stored"
            tiers.discard(tier)
            if not tiers:
                del self.held[key]

    def assert_matches(self, store: TieredStore) -> None:
        truth = {obj.key: {obj.tier} for obj in store.inventory()}
        assert self.held == truth


def test_completion_is_reported_once_with_chain_fields(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    mirror = Mirror()
    store.add_inventory_listener(mirror)
    ref = chunk_hashes(NS, list(range(2 * SPEC.chunk_tokens)))[1]
    writer = store.reserve(NS, ref.key, parent=ref.parent, num_tokens=9)
    writer.commit_layers(0b0011)
    assert mirror.calls == []  # half-written objects are not inventory
    assert list(store.inventory()) == []
    writer.commit_layers(0b1100)
    assert mirror.calls == [([(NS, ref.key, ref.parent, 9, "dram", None)], [])]
    assert list(store.inventory()) == [(NS, ref.key, ref.parent, 9, "dram", None)]
    assert not store.put(NS, ref.key, payload(ref.key))  # already stored: nothing reported
    assert len(mirror.calls) == 1
    store.close()


def test_delete_and_evict_report_removals_but_aborted_writes_do_not(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    mirror = Mirror()
    store.add_inventory_listener(mirror)
    keys = put_chain(store, 4)
    mirror.assert_matches(store)
    assert store.delete(NS, keys[3])
    assert mirror.calls[-1] == ([], [(NS, keys[3], "dram")])
    assert store.evict() == 3
    assert mirror.held == {} and list(store.inventory()) == []
    other = chunk_hashes(NS, list(range(100, 100 + SPEC.chunk_tokens)))[0]
    before = len(mirror.calls)
    writer = store.reserve(NS, other.key)
    assert store.delete(NS, other.key)  # aborts an in-flight write: it was never inventory
    writer.abort()
    with store.reserve(NS, other.key) as second:
        second.abort()
    assert len(mirror.calls) == before
    store.close()


def test_moves_between_tiers_report_the_new_tier_and_drop_the_old(tmp_path: Path) -> None:
    store = make_store(tmp_path, *DRAM_SSD)
    mirror = Mirror()
    store.add_inventory_listener(mirror)
    keys = put_chain(store, 6)
    store.flush()
    mirror.assert_matches(store)
    on_ssd = [k for k in keys if store.tier_of(NS, k) == "ssd"]
    assert len(on_ssd) == 4 and all(mirror.held[k] == {"ssd"} for k in on_ssd)
    moves = [c for c in mirror.calls if c[0] and c[1]]
    assert {(s[0][1], s[0][4], r[0][2]) for s, r in moves} == {(k, "ssd", "dram") for k in on_ssd}
    with store.get(NS, on_ssd[0]):  # promoted on hit
        pass
    store.flush()
    assert mirror.held[on_ssd[0]] == {store.tier_of(NS, on_ssd[0])} == {"dram"}
    mirror.assert_matches(store)
    store.close()  # persist_on_close spills the rest: still reported
    assert all(tiers == {"ssd"} for tiers in mirror.held.values()) and len(mirror.held) == 6


def test_corrupt_ssd_record_is_reported_removed(tmp_path: Path) -> None:
    store = make_store(tmp_path, TierConfig(TierKind.DRAM, 1 * CHUNK, page_size=PAGE), DRAM_SSD[1])
    mirror = Mirror()
    store.add_inventory_listener(mirror)
    keys = put_chain(store, 2)
    store.flush()
    assert mirror.held[keys[0]] == {"ssd"}
    extent = store._state.index.find(store._namespaces[NS.seed], keys[0]).handle  # type: ignore
    segment = next((tmp_path / "ssd").glob("seg-*.kvf"))
    with open(segment, "r+b") as f:
        f.seek(extent.payload_offset + 100)
        byte = f.read(1)
        f.seek(extent.payload_offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(NotFoundError, match="corrupt"):
        store.get(NS, keys[0])
    assert keys[0] not in mirror.held
    mirror.assert_matches(store)
    store.close()


def test_replay_reports_recovered_objects_and_inventory_lists_them(tmp_path: Path) -> None:
    store = make_store(tmp_path, *DRAM_SSD)
    keys = put_chain(store, 3)
    store.close()  # persist_on_close: everything goes to SSD
    store = make_store(tmp_path, *DRAM_SSD)
    silent, replayed = Mirror(), Mirror()
    store.add_inventory_listener(silent)
    store.add_inventory_listener(replayed, replay=True)
    assert silent.calls == []  # recovery happened before: only a replay reports it
    assert replayed.held == {k: {"ssd"} for k in keys}
    parents = {obj.key: obj.parent for obj in store.inventory()}
    assert parents == {keys[0]: ROOT, keys[1]: keys[0], keys[2]: keys[1]}
    store.close()


def test_a_failing_listener_does_not_break_the_store(tmp_path: Path) -> None:
    store = make_store(tmp_path)

    def broken(stored: list[StoredObject], removed: list[RemovedObject]) -> None:
        raise RuntimeError("listener bug")

    mirror = Mirror()
    store.add_inventory_listener(broken)
    store.add_inventory_listener(mirror)
    keys = put_chain(store, 2)
    assert store.delete(NS, keys[1])
    assert store.lookup(NS, keys).matched_chunks == 1
    mirror.assert_matches(store)
    store.close()
