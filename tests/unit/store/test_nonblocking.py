"""Inside ``store.nonblocking()`` an operation that would wait raises WouldBlockError before it
changes anything it cannot finish (the daemon then repeats it on a worker thread).

Each test puts the store where one operation has to wait, takes the store's observable state
(its stats, every index entry with its tier, readiness, flags, pins and storage, the leases
and quarantined reservations, the namespaces it holds, tenants' reservations in flight and
the SSD demotions pending), makes the operation raise WouldBlockError, and finds the state
unchanged. The negative control of each: the same operation, allowed to wait, changes it
(so the comparison sees what the operation does).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfabric.errors import WouldBlockError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.store.disk_moves import DiskMoves
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
NS = Namespace("blocking", SPEC)
PAGE = 4096
CHUNK_PAGES = -(-SPEC.chunk_bytes // PAGE)
REFS = chunk_hashes(NS, list(range(1, 1 + 8 * SPEC.chunk_tokens)))
DRAM = TierConfig(TierKind.DRAM, 4 * CHUNK_PAGES * PAGE, page_size=PAGE)
SSD = TierConfig(TierKind.SSD, 64 * (CHUNK_PAGES + 1) * PAGE, path="ssd", segment_bytes=1 << 20)
WAIT_S = 10.0


def observable(store: TieredStore) -> dict[str, Any]:
    """Everything an operation could change, read under the store lock."""
    with store._lock:
        entries = sorted(store._state.index.entries(), key=lambda e: (e.ns.seed, e.key))
        return {
            "stats": store.stats(),
            "entries": [
                (e.key, e.tier, e.ready, e.flags, e.pins, id(e.handle), e.ssd_copy) for e in entries
            ],
            "leases": sorted(store._leases.held),
            "quarantine": sorted(store._leases.quarantined),
            "namespaces": sorted(store._namespaces),
            "writes_in_flight": dict(store._tenancy._writers),
            "pending_demotion": list(store._state.pending_demotion),
        }


def put(store: TieredStore, index: int) -> bytes:
    ref = REFS[index]
    data = np.full(SPEC.chunk_bytes, index, dtype=np.uint8)
    assert store.put(NS, ref.key, data, parent=ref.parent)
    return ref.key


def make(tmp_path: Path, *tiers: TierConfig) -> TieredStore:
    return TieredStore(StoreConfig(data_dir=str(tmp_path), tiers=tiers), maintenance=False)


class Gate:
    """Holds the thread that reaches ``method`` of DiskMoves there until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        original = getattr(DiskMoves, method)

        def held(moves: DiskMoves, *args: Any, **kwargs: Any) -> Any:
            self.reached.set()
            assert self.opened.wait(WAIT_S), "the gate was never opened"
            return original(moves, *args, **kwargs)

        monkeypatch.setattr(DiskMoves, method, held)

    def wait_reached(self) -> None:
        assert self.reached.wait(WAIT_S), "nothing reached the gate"


@pytest.fixture
def dram_store(tmp_path: Path) -> Iterator[TieredStore]:
    store = make(tmp_path, DRAM)
    yield store
    store.close()


def test_reserve_that_must_wait_for_room_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full memory tier whose room comes from SSD demotions in flight: the reservation
    raises before it takes pages, an index entry, a lease or a namespace."""
    demotions = Gate(monkeypatch, "finish_disk_demotion")  # SSD writes stay in flight
    store = make(tmp_path, DRAM, SSD)
    try:
        for i in range(4):
            put(store, i)  # the memory tier is full
        new = REFS[4]
        before = observable(store)
        # The first try demotes a victim (an SSD write the writer finishes on its own), then
        # would wait for it: nothing of the reservation itself is left behind.
        with store.nonblocking(), pytest.raises(WouldBlockError):
            store.reserve(NS, new.key, parent=new.parent)
        demotions.wait_reached()
        started = observable(store)
        assert not store.contains(NS, new.key)
        for part in ("leases", "quarantine", "namespaces", "writes_in_flight"):
            assert started[part] == before[part], part
        assert started["stats"].puts == before["stats"].puts
        assert started["stats"].tier("dram").used_bytes == before["stats"].tier("dram").used_bytes
        assert started["pending_demotion"] != before["pending_demotion"]  # the victim's write
        # A try while that demotion is pending would only wait: it changes nothing at all.
        with store.nonblocking(), pytest.raises(WouldBlockError):
            store.reserve(NS, new.key, parent=new.parent)
        assert observable(store) == started
        # negative control: allowed to wait, the same reservation changes the state
        demotions.opened.set()
        with store.reserve(NS, new.key, parent=new.parent) as writer:
            assert observable(store) != started
            writer.abort()
    finally:
        demotions.opened.set()
        store.close()


def _demote_tail(tmp_path: Path) -> tuple[TieredStore, bytes]:
    """A store whose chain tail lives on the SSD (demoted above the high watermark)."""
    config = StoreConfig(
        data_dir=str(tmp_path), high_watermark=0.5, low_watermark=0.25, tiers=(DRAM, SSD)
    )
    store = TieredStore(config, maintenance=False)
    keys = [put(store, i) for i in range(3)]
    store.maintain()
    store.flush()
    assert store.tier_of(NS, keys[-1]) == "ssd"
    return store, keys[-1]


def test_get_that_must_read_from_ssd_changes_nothing(tmp_path: Path) -> None:
    store, key = _demote_tail(tmp_path)
    try:
        before = observable(store)
        with store.nonblocking(), pytest.raises(WouldBlockError, match="read back from SSD"):
            store.get(NS, key)
        assert observable(store) == before
        with store.get(NS, key):  # negative control: the read-back moves and pins it
            assert observable(store) != before
    finally:
        store.close()


def test_get_of_a_chunk_being_read_back_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, key = _demote_tail(tmp_path)
    reads = Gate(monkeypatch, "read_disk_record")
    readers = []
    reader_thread = threading.Thread(target=lambda: readers.append(store.get(NS, key)))
    try:
        reader_thread.start()
        reads.wait_reached()  # the first reader holds the chunk MOVING, outside the lock
        before = observable(store)
        with store.nonblocking(), pytest.raises(WouldBlockError, match="being read back"):
            store.get(NS, key)
        assert observable(store) == before
    finally:
        reads.opened.set()
        reader_thread.join(WAIT_S)
    assert observable(store) != before  # negative control: the waiting read lands
    for reader in readers:
        reader.release()
    store.close()


def test_wait_for_a_layer_not_committed_changes_nothing(dram_store: TieredStore) -> None:
    store = dram_store
    ref = REFS[0]
    with store.reserve(NS, ref.key, parent=ref.parent) as writer:
        with store.get(NS, ref.key) as reader:
            before = observable(store)
            with store.nonblocking(), pytest.raises(WouldBlockError, match="not committed"):
                reader.wait_layer(0)
            assert observable(store) == before
            writer.commit_layer(0)  # negative control: a commit is seen
            assert observable(store) != before
            reader.wait_layer(0)
        writer.commit()


def test_the_comparison_sees_a_change_in_any_part(dram_store: TieredStore) -> None:
    """Negative control of ``observable`` itself: a pin, a put and a lookup each show."""
    store = dram_store
    key = put(store, 0)
    before = observable(store)
    with store.get(NS, key):
        pinned = observable(store)
        assert pinned["entries"] != before["entries"]
        assert pinned["leases"] != before["leases"]
    put(store, 1)
    assert observable(store)["stats"] != before["stats"]
    counted = observable(store)
    store.lookup(NS, [key])
    assert observable(store)["stats"] != counted["stats"]
