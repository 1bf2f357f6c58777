"""TieredStore under random operation sequences, checked against a simple model.

A hypothesis state machine drives a store with tiny tiers (so demotion and eviction happen
on almost every step) through puts, chain puts, filler pressure, gets, pins and unpins,
deletes, lookups, read-everything sweeps, a layer-by-layer writer left open across steps, and
maintenance passes. The model is the map key -> (chunk, generation) of every acknowledged put
that was not deleted. After every step (once queued SSD demotions are finished and booked)
it checks:

1. no phantom objects: a key is stored only if the model holds it (or it is being written);
   an acknowledged object may vanish only through an eviction, and the store's eviction
   counters account for every one of them exactly (``evictions == vanished so far``). Every
   read of a stored object is byte-exact (payloads are deterministic per key, so a mix-up
   between objects is caught) and leaves the object in memory;
2. a lookup of a chain (chains come from prompts that share heads, so they branch) matches
   exactly the longest prefix of keys that are stored: never a chunk past a missing parent;
   its tokens are reported in the tiers the objects are in;
3. an object pinned by a held reader stays stored, in memory and byte-exact, whatever the
   other steps do;
4. a deleted object is gone (``contains`` False, ``get`` NotFoundError); deleting twice and
   releasing twice are harmless; deleting an object being written aborts the writer;
5. memory accounting is exact: each memory tier's ``used_bytes`` equals the pages of the
   objects the index places in it (``tier_of``) plus those of deleted objects still held by
   a reader or writer; per-tier object counts match, and the SSD holds exactly one live
   record per object the index places on it (no leaked records).

``CapacityError`` is accepted only while something is pinned. A second, smaller machine runs
the same checks on a DRAM-only store, where eviction is the only way to make room. Two plain
tests pin down ``flush()`` / ``close()`` against the SSD demotions' completion callbacks.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvfabric.errors import AlreadyExistsError, CapacityError, NotFoundError, ObjectAbortedError
from kvfabric.hashing import ROOT, ChunkRef, chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.store.disk_moves import DiskMoves
from kvfabric.store.handles import ObjectReader, ObjectWriter
from kvfabric.tiers.base import TierKind
from kvfabric.tiers.disk import DiskTier

# A full chunk is 2 layers x 2 planes x 2 heads x 8 tokens x 48 dims x 2 B = 6144 B: 1.5
# pages, so the allocator rounds up; a partial chunk of n tokens is 768*n B (1 or 2 pages).
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=48, chunk_tokens=8)
NS = Namespace("stateful", SPEC)
PAGE = 4096
CHUNK_PAGES = -(-SPEC.chunk_bytes // PAGE)
SSD_RECORD = PAGE + CHUNK_PAGES * PAGE  # header page + page-aligned payload


@dataclass(frozen=True)
class Obj:
    """A chunk the machine may store; a short name keeps failing examples readable."""

    name: str
    ref: ChunkRef

    @property
    def key(self) -> bytes:
        return self.ref.key

    def __repr__(self) -> str:
        return self.name


# Prompts that share heads, so the chains built from them branch; some end in a partial chunk.
_BASE = list(range(1, 41))  # 5 full chunks
PROMPTS = [
    _BASE,
    _BASE[:16] + list(range(100, 124)),  # shares 2 chunks with _BASE, then 3 of its own
    _BASE[:24] + [7] * 5,  # shares 3 chunks, then a partial chunk of 5 tokens
    _BASE[:16] + list(range(100, 108)) + list(range(300, 311)),  # branches off prompt 1
    _BASE[:8] + list(range(700, 730)),  # shares 1 chunk; 3 full + a partial of 6
    list(range(500, 520)),  # an unrelated chain: 2 full + a partial of 4
    [600],  # a single partial chunk of one token
]
_OBJS: dict[bytes, Obj] = {}
CHAINS: list[list[Obj]] = []
for _p, _tokens in enumerate(PROMPTS):
    _chain = []
    for _i, _ref in enumerate(chunk_hashes(NS, _tokens)):
        _obj = _OBJS.setdefault(_ref.key, Obj(f"p{_p}c{_i}", _ref))  # shared heads: first name
        assert _obj.ref == _ref
        _chain.append(_obj)
    CHAINS.append(_chain)
CHAIN_OBJS = list(_OBJS.values())
# Unrelated root objects used to apply pressure; sizes cycle through 1..8 tokens.
FILLERS = [
    Obj(f"f{i}", ChunkRef(xxhash.xxh3_128_digest(b"filler%d" % i), ROOT, i % SPEC.chunk_tokens + 1))
    for i in range(12)
]
ALL_OBJS = CHAIN_OBJS + FILLERS
UNKNOWN_KEYS = [xxhash.xxh3_128_digest(b"never stored %d" % i) for i in range(3)]

assert len({o.key for o in ALL_OBJS}) == len(ALL_OBJS)  # no collisions between chains, fillers
assert any(o.ref.num_tokens < SPEC.chunk_tokens for o in CHAIN_OBJS)


@cache
def expected(obj: Obj) -> bytes:
    """Deterministic bytes per key: objects that got mixed up would not match."""
    nbytes = SPEC.layout(obj.ref.num_tokens).nbytes
    rng = np.random.default_rng(int.from_bytes(obj.key, "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def layer_bytes(obj: Obj, layer: int) -> bytes:
    offset, length = SPEC.layout(obj.ref.num_tokens).layer_range(layer)
    return expected(obj)[offset : offset + length]


def pages_of(obj: Obj) -> int:
    return -(-SPEC.layout(obj.ref.num_tokens).nbytes // PAGE)


def settle(store: TieredStore) -> None:
    """Wait until every queued SSD demotion is written *and* booked (object on SSD, memory
    freed): the checks below depend on placement, which the writers' callbacks change."""
    store.flush()


def disk_tier(store: TieredStore) -> DiskTier:
    disk = store._state.tiers[-1]
    assert isinstance(disk, DiskTier)
    return disk


@dataclass
class Held:
    """A reader (or the writer) the machine keeps open across steps."""

    lease: ObjectReader | ObjectWriter
    obj: Obj
    gen: int


class StoreMachine(RuleBasedStateMachine):
    """DRAM (6 chunks) -> CXL (4 chunks) -> SSD (~24 chunks); maintenance driven by hand."""

    TIERS: tuple[TierConfig, ...] = (
        TierConfig(TierKind.DRAM, 6 * CHUNK_PAGES * PAGE, page_size=PAGE),
        TierConfig(TierKind.CXL, 4 * CHUNK_PAGES * PAGE, page_size=PAGE),
        # several segments fit in the capacity, so maintain() has sealed segments to compact
        TierConfig(TierKind.SSD, 24 * SSD_RECORD, path="ssd", segment_bytes=6 * SSD_RECORD),
    )
    MAX_PINS = 9  # up to 18 of the 20 memory pages: puts and reads back from SSD can fail

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kvfabric-stateful-")
        self.store: TieredStore = None  # type: ignore[assignment]  # built by open_store
        self.memory_tiers = {t.name for t in self.TIERS if t.kind is not TierKind.SSD}
        self.ssd_tier = next((t.name for t in self.TIERS if t.kind is TierKind.SSD), None)
        self.model: dict[bytes, Obj] = {}  # acknowledged and not deleted (maybe evicted)
        self.gen: dict[bytes, int] = {}  # generation of the model's object of a key
        self.next_gen = 0
        self.held: list[Held] = []  # open readers
        self.writer: Held | None = None  # an open, partly committed write
        self.evicted = 0  # model objects that vanished without a delete, pruned so far
        self.puts = self.deletes = 0  # acknowledged puts, successful deletes
        self.in_flight = False  # True while a rule lets SSD demotions overlap its operations

    @initialize(promote_on_hit=st.booleans())
    def open_store(self, promote_on_hit: bool) -> None:
        """Without promotion on hit, pinned objects stay in lower memory tiers, so demotions
        into a tier full of pins (which must evict, and count it) happen too."""
        config = StoreConfig(
            data_dir=self.tmp,
            tiers=self.TIERS,
            high_watermark=0.75,
            low_watermark=0.5,
            promote_on_hit=promote_on_hit,
            pin_timeout_s=3600.0,
            reservation_timeout_s=3600.0,
        )
        self.store = TieredStore(config, maintenance=False)

    def teardown(self) -> None:
        if self.store is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:  # no assertions here: they could mask the failure that ended the run
            for held in self.held:
                held.lease.release()  # type: ignore[union-attr]
            if self.writer is not None:
                self.writer.lease.abort()  # type: ignore[union-attr]
        finally:
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def contains(self, key: bytes) -> bool:
        return self.store.contains(NS, key)

    def _done(self) -> None:
        """Let the SSD demotions an operation queued finish before the next one, except in
        ``pressure``. The store is then (nearly) deterministic, so hypothesis can replay and
        shrink a failure; ``pressure`` covers operations that overlap demotions."""
        if not self.in_flight:
            settle(self.store)

    def writing(self, key: bytes) -> bool:
        """``key`` is the open writer's object, still indexed (not deleted meanwhile)."""
        return (
            self.writer is not None
            and self.writer.obj.key == key
            and key not in self.model
            and self.writer.gen == -1
        )

    def is_current(self, held: Held) -> bool:
        """The held reader's object is the model's current object of its key."""
        return held.obj.key in self.model and self.gen[held.obj.key] == held.gen

    def _acknowledge(self, obj: Obj) -> None:
        if obj.key in self.model:  # its previous object was evicted earlier in this step
            self.evicted += 1
        self.model[obj.key] = obj
        self.gen[obj.key] = self.next_gen
        self.next_gen += 1
        self.puts += 1

    def _put(self, obj: Obj) -> bool:
        """Put one object and update the model; True if the store acknowledged it."""
        was_present = self.contains(obj.key)
        try:
            stored = self.store.put(
                NS, obj.key, expected(obj), parent=obj.ref.parent, num_tokens=obj.ref.num_tokens
            )
        except CapacityError:
            self._done()
            # only pins (readers, the open writer) can fill every memory tier
            assert self.held or self.writer, "CapacityError although nothing is pinned"
            assert not was_present and not self.contains(obj.key)
            return False
        self._done()
        if not stored:
            assert was_present and (obj.key in self.model or self.writing(obj.key))
            assert self.contains(obj.key)
            return False
        assert not was_present
        self._acknowledge(obj)
        return True

    def _get(self, obj: Obj) -> None:
        """get() an object: exact bytes (ending up in memory) if stored, else NotFoundError."""
        if not self.contains(obj.key):
            with pytest.raises(NotFoundError):
                self.store.get(NS, obj.key)
            return
        if self.writing(obj.key):  # readers may pin an object still being written
            with self.store.get(NS, obj.key) as reader:
                assert not reader.complete and reader.ready(0) and not reader.ready(1)
                assert b"".join(p.tobytes() for p in reader.layer_pieces(0)) == layer_bytes(obj, 0)
            return
        assert obj.key in self.model, f"{obj} is stored but was never acknowledged"
        try:
            with self.store.get(NS, obj.key) as reader:
                assert reader.num_tokens == obj.ref.num_tokens
                data = reader.to_bytes()
        except CapacityError:
            self._done()
            # an SSD object needs memory to be read back into; only pins can deny it
            assert self.held or self.writer, "CapacityError on get although nothing is pinned"
            assert self.store.tier_of(NS, obj.key) == self.ssd_tier
            return
        self._done()
        assert data == expected(obj), f"{obj} read back wrong bytes"
        assert self.store.tier_of(NS, obj.key) in self.memory_tiers

    # ------------------------------------------------------------------ rules

    @rule(obj=st.sampled_from(ALL_OBJS))
    def put(self, obj: Obj) -> None:
        self._put(obj)

    @rule(chain=st.sampled_from(CHAINS), start=st.integers(0, 2))
    def put_chain(self, chain: list[Obj], start: int) -> None:
        """A prompt's chunks in order (from ``start``: a chain may lack its head)."""
        for obj in chain[start:]:
            self._put(obj)

    @rule(first=st.integers(0, len(FILLERS) - 1), count=st.integers(1, 8), read=st.booleans())
    def pressure(self, first: int, count: int, read: bool) -> None:
        """Rewrite ``count`` fillers (delete, put, maybe read back) while SSD demotions are in
        flight: deletes, puts and reads then meet objects that are still being demoted."""
        self.in_flight = True
        try:
            for i in range(first, first + count):
                obj = FILLERS[i % len(FILLERS)]
                if self.writing(obj.key):
                    continue
                if self.store.delete(NS, obj.key):
                    del self.model[obj.key]
                    self.deletes += 1
                self._put(obj)
                if read:
                    self._get(FILLERS[(i - 1) % len(FILLERS)])
        finally:
            self.in_flight = False

    @rule(obj=st.sampled_from(ALL_OBJS))
    def get(self, obj: Obj) -> None:
        self._get(obj)

    @rule()
    def read_all(self) -> None:
        """Read every model object in turn (each read may demote or evict the others)."""
        for obj in list(self.model.values()):
            self._get(obj)

    # No rule has a precondition on the machine's state: what the store did (which objects
    # it evicted, whether a pin succeeded) may depend on when SSD writes complete, and a
    # precondition that depends on it makes hypothesis see inconsistent data generation.

    @rule(objs=st.lists(st.sampled_from(ALL_OBJS), min_size=1, max_size=3))
    def pin(self, objs: list[Obj]) -> None:
        """Pin objects and keep the readers (the oldest goes once MAX_PINS are held)."""
        for obj in objs:
            if len(self.held) >= self.MAX_PINS:
                self._unpin(0)
            self._pin(obj)

    def _pin(self, obj: Obj) -> None:
        if not self.contains(obj.key):
            with pytest.raises(NotFoundError):
                self.store.pin(NS, obj.key, lease_s=3600.0)
            return
        if self.writing(obj.key):
            return
        try:
            reader = self.store.pin(NS, obj.key, lease_s=3600.0)
        except CapacityError:
            self._done()
            assert self.held or self.writer, "CapacityError on pin although nothing is pinned"
            assert self.store.tier_of(NS, obj.key) == self.ssd_tier
            return
        self._done()
        assert reader.to_bytes() == expected(obj)
        assert reader.tier in self.memory_tiers
        self.held.append(Held(reader, obj, self.gen[obj.key]))

    @rule(obj=st.sampled_from(ALL_OBJS), spare_first_tier=st.booleans())
    def put_while_all_pinned(self, obj: Obj, spare_first_tier: bool) -> None:
        """Pin every stored object (SSD ones are read back while memory lasts), then put.

        Once memory is all pinned the put must fail with CapacityError and store nothing,
        and no pinned object may move or go. Sparing the first tier's objects leaves victims
        there whose demotion finds the tier below full of pins: they must be evicted, and
        counted.
        """
        first = self.store.tier_names[0]
        before = len(self.held)
        for stored in list(self.model.values()):
            if self.contains(stored.key) and not (
                spare_first_tier and self.store.tier_of(NS, stored.key) == first
            ):
                self._pin(stored)
        self._put(obj)
        while len(self.held) > before:
            self._unpin(len(self.held) - 1)

    @rule(i=st.integers(0, 7))
    def unpin(self, i: int) -> None:
        if self.held:
            self._unpin(i % len(self.held))

    def _unpin(self, i: int) -> None:
        held = self.held.pop(i)
        reader = held.lease
        assert isinstance(reader, ObjectReader)
        assert reader.to_bytes() == expected(held.obj)
        reader.release()
        reader.release()  # double release is harmless
        self.store.unpin(reader)  # ... through the store too
        with pytest.raises(ValueError, match="released"):
            reader.to_bytes()

    @rule(obj=st.sampled_from(ALL_OBJS))
    def begin_write(self, obj: Obj) -> None:
        """Reserve an object and commit only its first layer; it stays open across steps."""
        if self.writer is not None:
            return
        if self.contains(obj.key):
            with pytest.raises(AlreadyExistsError):
                self.store.reserve(
                    NS, obj.key, parent=obj.ref.parent, num_tokens=obj.ref.num_tokens
                )
            return
        try:
            writer = self.store.reserve(
                NS, obj.key, parent=obj.ref.parent, num_tokens=obj.ref.num_tokens
            )
        except CapacityError:
            self._done()
            assert self.held, "CapacityError on reserve although nothing is pinned"
            return
        self._done()
        assert writer.tier in self.memory_tiers
        writer.write_layer(0, np.frombuffer(layer_bytes(obj, 0), dtype=np.uint8))
        writer.commit_layer(0)
        self.writer = Held(writer, obj, -1)  # gen -1: not acknowledged yet
        assert self.contains(obj.key) and self.writing(obj.key)

    @rule(commit=st.booleans())
    def finish_write(self, commit: bool) -> None:
        held, self.writer = self.writer, None
        if held is None:
            return
        writer = held.lease
        assert isinstance(writer, ObjectWriter)
        deleted = held.gen == -2
        with writer:
            if not commit:
                writer.abort()
                writer.abort()  # idempotent
            elif deleted:
                with pytest.raises(ObjectAbortedError):
                    writer.commit()
            else:
                writer.write_layer(1, np.frombuffer(layer_bytes(held.obj, 1), dtype=np.uint8))
                writer.commit()
                self._acknowledge(held.obj)
        if commit and not deleted:
            assert self.contains(held.obj.key)
            self._get(held.obj)
        elif not deleted or held.obj.key not in self.model:
            assert not self.contains(held.obj.key)

    @rule(obj=st.sampled_from(ALL_OBJS))
    def delete(self, obj: Obj) -> None:
        present = self.contains(obj.key)
        assert self.store.delete(NS, obj.key) is present
        self.deletes += present
        if present and self.writing(obj.key):
            assert self.writer is not None
            self.writer.gen = -2  # aborted by the delete; its pages go when the writer does
        elif present:
            del self.model[obj.key]
        assert not self.contains(obj.key)
        with pytest.raises(NotFoundError):
            self.store.get(NS, obj.key)
        assert self.store.delete(NS, obj.key) is False  # double delete is harmless

    @rule(chain=st.sampled_from(CHAINS), extra=st.integers(0, len(UNKNOWN_KEYS)))
    def lookup(self, chain: list[Obj], extra: int) -> None:
        keys = [obj.key for obj in chain] + UNKNOWN_KEYS[:extra]
        result = self.store.lookup(NS, keys)
        longest = 0
        while longest < len(keys) and self.contains(keys[longest]):
            longest += 1
        assert result.requested_chunks == len(keys)
        assert result.matched_chunks == longest
        matched = chain[: result.matched_chunks]
        for parent, child in pairwise(matched):  # no chunk past a missing parent
            assert child.ref.parent == parent.key and self.contains(parent.key)
        assert result.matched_tokens == sum(obj.ref.num_tokens for obj in matched)
        tiers: Counter[str] = Counter()
        for obj in matched:
            tiers[self.store.tier_of(NS, obj.key)] += obj.ref.num_tokens
        assert result.tier_tokens == dict(tiers)

    @rule()
    def maintain(self) -> None:
        self.store.maintain()
        self._done()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self) -> None:
        store = self.store
        settle(store)
        stats = store.stats()

        # (1) vanished without a delete == evicted, exactly; nothing unacknowledged is stored
        vanished = [key for key in self.model if not self.contains(key)]
        assert stats.evictions == self.evicted + len(vanished), (
            f"evictions={stats.evictions}, but {self.evicted} + {len(vanished)} acknowledged "
            f"objects vanished without a delete"
        )
        for key in vanished:
            del self.model[key]
        self.evicted += len(vanished)
        indexed = dict(self.model)
        if self.writer is not None and self.writing(self.writer.obj.key):
            indexed[self.writer.obj.key] = self.writer.obj
        for obj in ALL_OBJS:
            if obj.key not in indexed:
                assert not self.contains(obj.key), f"{obj} is stored but was never acknowledged"
        assert stats.objects == len(store) == len(indexed)
        assert (stats.puts, stats.deletes) == (self.puts, self.deletes)

        # (5) placement and exact memory accounting
        where = {key: store.tier_of(NS, key) for key in indexed}
        per_tier_objects = Counter(where.values())
        pages: Counter[str] = Counter()
        for key, tier in where.items():
            pages[tier] += pages_of(indexed[key])
        dead: dict[tuple[bytes, int], Held] = {}  # dropped objects a lease still holds
        for held in self.held:
            if not self.is_current(held):
                dead[(held.obj.key, held.gen)] = held
        if self.writer is not None and self.writer.gen == -2:
            dead[(self.writer.obj.key, -2)] = self.writer
        for held in dead.values():
            pages[held.lease.tier] += pages_of(held.obj)
        for tier in stats.tiers:
            assert tier.objects == per_tier_objects[tier.name], tier
            if tier.name in self.memory_tiers:
                assert tier.used_bytes == pages[tier.name] * PAGE, (
                    f"{tier.name}: {tier.used_bytes} B used, but the objects there and the "
                    f"dropped ones still held need {pages[tier.name] * PAGE} B"
                )
        if self.ssd_tier is not None:
            # objects read back from SSD keep their record there until the space is needed
            copies = store._placement._residency.copies
            assert all(e.tier != store._state.disk_index and e.ssd_copy is not None for e in copies)
            assert disk_tier(store).stats().records_live == per_tier_objects[self.ssd_tier] + len(
                copies
            ), "SSD live records != objects the index places on the SSD + kept copies"

        # (3) pinned objects stay stored, in memory, byte-exact
        for held in self.held:
            reader = held.lease
            assert isinstance(reader, ObjectReader)
            if self.is_current(held):
                assert self.contains(held.obj.key)
                assert where[held.obj.key] in self.memory_tiers
            assert reader.tier in self.memory_tiers
            assert reader.to_bytes() == expected(held.obj), f"pinned {held.obj} changed"
        if self.writer is not None:
            assert self.writer.lease.tier in self.memory_tiers


class MemoryOnlyMachine(StoreMachine):
    """A DRAM-only store (6 chunks): eviction is the only way to make room."""

    TIERS = (TierConfig(TierKind.DRAM, 6 * CHUNK_PAGES * PAGE, page_size=PAGE),)
    MAX_PINS = 6  # with the open writer, enough to fill the tier


_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much]

TestTieredStoreStateful = StoreMachine.TestCase
TestTieredStoreStateful.settings = settings(
    max_examples=400, stateful_step_count=60, deadline=None, suppress_health_check=_HEALTH
)

TestMemoryOnlyStoreStateful = MemoryOnlyMachine.TestCase
TestMemoryOnlyStoreStateful.settings = settings(
    max_examples=250, stateful_step_count=50, deadline=None, suppress_health_check=_HEALTH
)


# ---------------------------------------------------------------------- flush / close


def _demoting_store(tmp_path: Path) -> tuple[TieredStore, list[Obj]]:
    """A store whose maintain() queues SSD demotions of a 3-chunk chain's tail."""
    config = StoreConfig(
        data_dir=str(tmp_path),
        high_watermark=0.5,
        low_watermark=0.25,
        tiers=(
            TierConfig(TierKind.DRAM, 4 * CHUNK_PAGES * PAGE, page_size=PAGE),
            TierConfig(TierKind.SSD, 64 * SSD_RECORD, path="ssd", segment_bytes=1 << 20),
        ),
    )
    store = TieredStore(config, maintenance=False)
    chain = CHAINS[0][:3]
    for obj in chain:
        store.put(NS, obj.key, expected(obj), parent=obj.ref.parent, num_tokens=obj.ref.num_tokens)
    store.maintain()  # 3 of 4 chunks used > the high watermark: the tail goes to the SSD
    return store, chain


def test_flush_covers_the_demotions_it_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ``flush()`` the SSD demotions it waited for are booked: object on SSD, memory free.

    ``concurrent.futures`` wakes ``wait()`` before it runs a future's done-callbacks, and the
    store books a demotion in such a callback: a writer thread descheduled in between
    (simulated by a slow callback) must not leave the demotion unbooked after flush().
    """
    finish = DiskMoves.finish_disk_demotion

    def slow_finish(self: DiskMoves, *args: object) -> None:
        time.sleep(0.2)
        finish(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskMoves, "finish_disk_demotion", slow_finish)
    store, chain = _demoting_store(tmp_path)
    try:
        store.flush()
        assert store.tier_of(NS, chain[-1].key) == "ssd"
        stats = store.stats()
        assert stats.tier("dram").used_bytes == stats.tier("dram").objects * CHUNK_PAGES * PAGE
        assert disk_tier(store).stats().records_live == stats.tier("ssd").objects >= 1
    finally:
        store.close()


def test_close_does_not_deadlock_with_a_pending_demotion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` must not hold the store lock while it joins the SSD writer threads.

    A demotion callback still running when close() starts needs the store lock; close()
    joins the disk tier's writers, so holding that lock meanwhile would deadlock. The slow
    callback here gives up after a few seconds instead of hanging the suite, and says so.
    """
    finish = DiskMoves.finish_disk_demotion
    starved = threading.Event()

    def slow_finish(self: DiskMoves, *args: object) -> None:
        time.sleep(0.2)
        if not self._state.cond.acquire(timeout=3):
            starved.set()  # a deadlock without the timeout
            return
        try:
            finish(self, *args)  # type: ignore[arg-type]
        finally:
            self._state.cond.release()

    monkeypatch.setattr(DiskMoves, "finish_disk_demotion", slow_finish)
    store, _ = _demoting_store(tmp_path)
    store.close()
    assert not starved.is_set(), "close() held the store lock while joining the SSD writers"


def test_a_write_aborted_by_a_delete_counts_once(tmp_path: Path) -> None:
    """``aborted_writes`` counts writes: one deleted while in flight is one aborted write.

    The delete aborts the entry, and the writer giving up its reservation afterwards (the
    refused commit, leaving its ``with`` block) must not count the same write again.
    """
    store = TieredStore(
        StoreConfig(data_dir=str(tmp_path), tiers=StoreMachine.TIERS[:1]), maintenance=False
    )
    try:
        obj = FILLERS[0]
        with store.reserve(NS, obj.key, num_tokens=obj.ref.num_tokens) as writer:
            assert store.delete(NS, obj.key)
            with pytest.raises(ObjectAbortedError):
                writer.commit()
        stats = store.stats()
        assert (stats.deletes, stats.aborted_writes) == (1, 1)
        assert stats.tier("dram").used_bytes == 0 and not store.contains(NS, obj.key)
    finally:
        store.close()
