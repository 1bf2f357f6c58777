"""A chunk's own token ids: kept with it when its writer gives them, checked against its key,
reported by the inventory, carried through tier moves and across a restart over the SSD."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvfabric.errors import TokenMismatchError
from kvfabric.hashing import ROOT, ChunkRef, chunk_hashes
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.store.codec import decode_meta, encode_meta
from kvfabric.store.index import Entry
from kvfabric.store.protocol import RemovedObject, StoredObject
from kvfabric.tiers.base import TierKind
from kvfabric.tiers.disk.records import MAX_META

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("tiny", SPEC)
CHUNK = SPEC.chunk_bytes
PAGE = 4096
DRAM = TierConfig(TierKind.DRAM, 16 * CHUNK, page_size=PAGE)
DRAM_SSD = (
    TierConfig(TierKind.DRAM, 2 * CHUNK, page_size=PAGE),
    TierConfig(TierKind.SSD, 64 * CHUNK, path="ssd", segment_bytes=1 << 20),
)
PROMPT = np.arange(1000, 1000 + 3 * SPEC.chunk_tokens + 5, dtype=np.int32)  # a partial last one


def make_store(tmp_path: Path, *tiers: TierConfig, **policy: object) -> TieredStore:
    config = StoreConfig(data_dir=str(tmp_path), tiers=tiers or (DRAM,), **policy)  # type: ignore
    return TieredStore(config, maintenance=False)


def own_tokens(ns: Namespace = NS, prompt: np.ndarray = PROMPT) -> list[tuple[ChunkRef, bytes]]:
    """Each chunk of ``prompt`` with its own token ids (int32-LE)."""
    step = ns.spec.chunk_tokens
    return [
        (ref, prompt[i * step : i * step + ref.num_tokens].astype("<i4").tobytes())
        for i, ref in enumerate(chunk_hashes(ns, prompt))
    ]


def zeros(ref: ChunkRef, spec: KVSpec = SPEC) -> np.ndarray:
    return np.zeros(spec.layout(ref.num_tokens).nbytes, np.uint8)


def tokens_held(store: TieredStore) -> dict[bytes, bytes | None]:
    return {obj.key: obj.tokens for obj in store.inventory()}


def test_tokens_are_kept_and_reported_in_every_form(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    reported: list[StoredObject] = []

    def listener(stored: list[StoredObject], removed: list[RemovedObject]) -> None:
        reported.extend(stored)

    store.add_inventory_listener(listener)
    chunks = own_tokens()
    forms = [  # bytes, a numpy array of another int type, a list of ints
        chunks[0][1],
        np.frombuffer(chunks[1][1], "<i4").astype(np.int64),
        np.frombuffer(chunks[2][1], "<i4").tolist(),
    ]
    for (ref, _), form in zip(chunks, forms):
        assert store.put(NS, ref.key, zeros(ref), parent=ref.parent, tokens=form)
    last, last_tokens = chunks[3]
    with store.reserve(
        NS, last.key, parent=last.parent, num_tokens=last.num_tokens, tokens=last_tokens
    ) as writer:
        writer.commit()
    expected = {ref.key: tokens for ref, tokens in chunks}
    assert tokens_held(store) == expected
    assert {obj.key: obj.tokens for obj in reported} == expected
    obj = next(o for o in store.inventory() if o.key == last.key)
    assert (obj.ns, obj.parent, obj.num_tokens, obj.tier) == (NS, last.parent, 5, "dram")
    assert obj == (NS, last.key, last.parent, 5, "dram", last_tokens)  # still a tuple
    store.close()


def test_a_chunk_put_without_tokens_reports_none(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ref, _ = own_tokens()[0]
    assert store.put(NS, ref.key, zeros(ref))
    assert tokens_held(store) == {ref.key: None}
    store.close()


@pytest.mark.parametrize("fault", ["one id changed", "one id short", "one id more", "odd bytes"])
def test_tokens_that_are_not_the_chunks_own_are_refused_and_nothing_is_stored(
    tmp_path: Path, fault: str
) -> None:
    store = make_store(tmp_path)
    ref, good = own_tokens()[1]
    bad = {
        "one id changed": good[:8] + (123456).to_bytes(4, "little") + good[12:],
        "one id short": good[:-4],
        "one id more": good + good[:4],
        "odd bytes": good[:-1],
    }[fault]
    with pytest.raises(TokenMismatchError, match=ref.key.hex()):
        store.reserve(NS, ref.key, parent=ref.parent, tokens=bad)
    with pytest.raises(TokenMismatchError):
        store.put(NS, ref.key, zeros(ref), parent=ref.parent, tokens=bad)
    assert not store.contains(NS, ref.key) and len(store) == 0
    assert store.stats().tiers[0].used_bytes == 0  # nothing was allocated either
    # its own tokens under another parent are refused too: the parent is hashed in
    with pytest.raises(TokenMismatchError):
        store.reserve(NS, ref.key, parent=ROOT, tokens=good)
    # negative control: the chunk's own tokens are taken
    assert store.put(NS, ref.key, zeros(ref), parent=ref.parent, tokens=good)
    assert tokens_held(store) == {ref.key: good}
    store.close()


def test_tokens_hash_with_the_namespace(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    other = Namespace("other-model", SPEC)
    ref, tokens = own_tokens(other)[0]
    with pytest.raises(TokenMismatchError):  # the same ids, hashed in another namespace
        store.reserve(NS, ref.key, tokens=tokens)
    assert store.put(other, ref.key, zeros(ref), tokens=tokens)
    store.close()


def test_a_rank_joining_without_tokens_keeps_them_and_a_late_rank_adds_them(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path)
    (first, first_tokens), (second, second_tokens) = own_tokens()[:2]
    heads = SPEC.num_kv_heads // 2
    # tokens first, then a rank without: kept
    a = store.reserve(NS, first.key, heads=(0, heads), tokens=first_tokens)
    b = store.reserve(NS, first.key, heads=(heads, SPEC.num_kv_heads))
    # none first, then a rank with them: taken; a rank with wrong ones is refused
    c = store.reserve(NS, second.key, parent=second.parent, heads=(0, heads))
    with pytest.raises(TokenMismatchError):
        store.reserve(
            NS, second.key, parent=second.parent, heads=(heads, SPEC.num_kv_heads), tokens=b"x" * 64
        )
    d = store.reserve(
        NS, second.key, parent=second.parent, heads=(heads, SPEC.num_kv_heads), tokens=second_tokens
    )
    for writer in (a, b, c, d):
        writer.commit()
    assert tokens_held(store) == {first.key: first_tokens, second.key: second_tokens}
    store.close()


def test_tokens_follow_moves_between_tiers_and_survive_a_restart(tmp_path: Path) -> None:
    store = make_store(tmp_path, *DRAM_SSD, persist_on_close=True)
    chunks = own_tokens()
    for ref, tokens in chunks[:3]:
        assert store.put(NS, ref.key, zeros(ref), parent=ref.parent, tokens=tokens)
    last = chunks[3][0]
    assert store.put(NS, last.key, zeros(last), parent=last.parent, num_tokens=5)  # without
    store.flush()
    expected = {ref.key: tokens for ref, tokens in chunks[:3]} | {last.key: None}
    assert "ssd" in {obj.tier for obj in store.inventory()}  # demoted ones kept them
    assert tokens_held(store) == expected
    with store.get(NS, chunks[0][0].key):  # promoted back on hit
        pass
    assert store.tier_of(NS, chunks[0][0].key) == "dram"
    assert tokens_held(store) == expected
    store.close()  # everything goes to SSD

    store = make_store(tmp_path, *DRAM_SSD)
    assert {obj.tier for obj in store.inventory()} == {"ssd"}
    assert tokens_held(store) == expected  # recovered from the records' metadata
    store.close()


def test_a_record_without_tokens_reads_as_before() -> None:
    """Records written before tokens were kept (and those written without) recover with
    None: an entry without tokens encodes to exactly the old metadata."""
    ref, tokens = own_tokens()[0]
    old = msgpack.packb(
        {
            "v": 1,
            "parent": ref.parent,
            "tokens": ref.num_tokens,
            "model": NS.model_id,
            "tenant": NS.tenant_salt,
            "lora": NS.lora_id,
            "spec": SPEC.to_dict(),
        }
    )
    entry = Entry(ref.key, ref.parent, NS, ref.num_tokens, 0, None)
    assert encode_meta(entry) == old
    assert decode_meta(old) == (NS, ref.parent, ref.num_tokens, "native", None)
    entry.tokens = tokens
    assert decode_meta(encode_meta(entry)) == (NS, ref.parent, ref.num_tokens, "native", tokens)
    bad = msgpack.unpackb(encode_meta(entry))
    bad["tk"] = tokens[:-4]  # negative control: a token count that is not the chunk's
    with pytest.raises(ValueError, match="token"):
        decode_meta(msgpack.packb(bad))


def test_an_old_format_record_on_disk_recovers_without_tokens(tmp_path: Path) -> None:
    store = make_store(tmp_path, *DRAM_SSD)
    chunks = own_tokens()[:2]
    for ref, _ in chunks:
        assert store.put(NS, ref.key, zeros(ref), parent=ref.parent)
    store.close()
    store = make_store(tmp_path, *DRAM_SSD)
    assert tokens_held(store) == {ref.key: None for ref, _ in chunks}
    assert store.lookup(NS, [ref.key for ref, _ in chunks]).matched_chunks == 2
    store.close()


def test_tokens_too_long_for_a_records_metadata_are_left_off_it(tmp_path: Path) -> None:
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16", chunk_tokens=1024)
    ns = Namespace("long-chunks", spec)
    prompt = np.arange(2 * spec.chunk_tokens, dtype=np.int32)
    (ref, tokens), (short, short_tokens) = own_tokens(ns, prompt[: spec.chunk_tokens + 8])
    assert len(tokens) > MAX_META
    tiers = (
        TierConfig(TierKind.DRAM, 64 * spec.chunk_bytes, page_size=PAGE),
        TierConfig(TierKind.SSD, 64 * spec.chunk_bytes, path="ssd", segment_bytes=1 << 20),
    )
    store = make_store(tmp_path, *tiers)
    assert store.put(ns, ref.key, zeros(ref, spec), tokens=tokens)
    assert store.put(
        ns, short.key, zeros(short, spec), parent=short.parent, num_tokens=8, tokens=short_tokens
    )
    assert tokens_held(store) == {ref.key: tokens, short.key: short_tokens}  # in memory: kept
    store.close()
    store = make_store(tmp_path, *tiers)
    assert tokens_held(store) == {ref.key: None, short.key: short_tokens}
    store.close()
