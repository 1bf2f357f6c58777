"""LocalIndex: chain bookkeeping and prefix-aware victim order."""

from __future__ import annotations

from kvfabric.hashing import ROOT
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store.index import MOVING, READY_ALL, Entry, LocalIndex

NS = Namespace("m", KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4))
OTHER = Namespace("m", KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4), "t2")


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def entry(i: int, parent: int | None, tier: int = 0) -> Entry:
    e = Entry(key(i), ROOT if parent is None else key(parent), NS, 4, tier, None)
    e.ready = READY_ALL
    return e


def chain(index: LocalIndex, ids: list[int], tier: int = 0) -> list[Entry]:
    out, parent = [], None
    for i in ids:
        out.append(entry(i, parent, tier))
        index.add(out[-1])
        parent = i
    return out


def test_only_chain_tails_are_leaves() -> None:
    index = LocalIndex(1)
    a = chain(index, [1, 2, 3])
    b = chain(index, [10, 11])
    assert index.candidates(0) == [key(3), key(11)]
    assert [len(e.children) for e in a] == [1, 1, 0]
    assert index.pick_victim(0) is a[2]
    index.touch(a[2])
    assert index.pick_victim(0) is b[1]


def test_evicting_a_leaf_exposes_its_parent_next() -> None:
    index = LocalIndex(1)
    a = chain(index, [1, 2, 3])
    chain(index, [10, 11])
    index.remove(a[2])
    assert index.pick_victim(0) is a[1]  # the chain keeps shrinking from its tail


def test_pinned_moving_and_incomplete_leaves_are_skipped() -> None:
    index = LocalIndex(1)
    a = chain(index, [1])
    b = chain(index, [2])
    c = chain(index, [3])
    a[0].pins = 1
    b[0].flags |= MOVING
    assert index.pick_victim(0) is c[0]
    c[0].ready = 1
    assert index.pick_victim(0) is None


def test_longest_prefix_stops_at_first_miss_and_at_foreign_namespace() -> None:
    index = LocalIndex(1)
    a = chain(index, [1, 2, 3, 4])
    assert index.longest_prefix(NS, [key(i) for i in (1, 2, 3, 4, 5)]) == a
    index.remove(a[1])
    assert index.longest_prefix(NS, [key(i) for i in (1, 2, 3, 4)]) == a[:1]
    assert index.longest_prefix(OTHER, [key(1)]) == []


def test_child_stored_before_parent_is_counted_when_parent_arrives() -> None:
    index = LocalIndex(1)
    child = entry(2, 1)
    index.add(child)
    parent = entry(1, None)
    index.add(parent)
    assert parent.children == [child] and index.candidates(0) == [key(2)]
    index.remove(parent)
    index.add(parent)
    assert parent.children == [child]


def test_a_parent_whose_children_moved_down_can_move_down_too() -> None:
    index = LocalIndex(2)
    a = chain(index, [1, 2, 3])
    assert index.candidates(0) == [key(3)]
    index.move(a[2], 1, "handle")
    assert a[2].handle == "handle"
    assert index.candidates(0) == [key(2)] and index.candidates(1) == [key(3)]
    assert index.tier_count(0) == 2 and index.tier_count(1) == 1
    index.move(a[1], 1, None)
    # in the last tier only true leaves may go: the middle chunk has a child there
    assert index.candidates(0) == [key(1)] and index.candidates(1) == [key(3)]


def test_a_chain_inverted_across_tiers_still_has_candidates() -> None:
    index = LocalIndex(3)
    a = chain(index, [1, 2, 3])
    index.move(a[0], 1, None)
    index.move(a[1], 1, None)  # parent and child in tier 1, grandchild faster (tier 0)
    assert index.candidates(1) == [key(2)]  # no child in its own tier: it may move down


def test_branching_prefix_stays_until_every_branch_moved() -> None:
    index = LocalIndex(3)
    root = chain(index, [1])[0]
    left, right = entry(2, 1), entry(3, 1)
    index.add(left)
    index.add(right)
    assert root.children == [left, right]
    index.move(left, 1, None)
    assert key(1) not in index.candidates(0)
    index.move(right, 1, None)
    assert key(1) in index.candidates(0)
    index.remove(right)
    assert root.children == [left]


def test_a_key_replayed_by_another_namespace_neither_blocks_nor_sees_the_first() -> None:
    index = LocalIndex(1)
    owner = chain(index, [1, 2])
    squatter = Entry(key(2), key(1), OTHER, 4, 0, None)
    squatter.ready = READY_ALL
    index.add(squatter)  # same key, other namespace: stored on the side
    assert index.find(NS, key(2)) is owner[1] and index.find(OTHER, key(2)) is squatter
    assert index.longest_prefix(NS, [key(1), key(2)]) == owner
    assert index.longest_prefix(OTHER, [key(1), key(2)]) == []  # OTHER has no key(1)
    assert len(index) == 3 and set(index.any_with_key(key(2))) == {owner[1], squatter}
    index.remove(owner[1])
    assert index.find(OTHER, key(2)) is squatter and index.find(NS, key(2)) is None
    index.add(owner[1])  # the owner comes back: the squatter stays where it is
    assert index.find(NS, key(2)) is owner[1] and index.find(OTHER, key(2)) is squatter


def test_prefix_counts_per_tier_stop_at_a_miss_a_foreign_key_and_a_partial_write() -> None:
    index = LocalIndex(2)
    a = chain(index, [1, 2, 3, 4, 5])
    index.move(a[4], 1, None)
    index.move(a[3], 1, None)
    keys = [key(i) for i in (1, 2, 3, 4, 5, 6)]
    assert index.prefix_counts(NS, keys) == ([3, 2], [12, 8])
    partial = Entry(key(6), key(5), NS, 3, 1, None)  # a last chunk of 3 tokens
    index.add(partial)
    assert index.prefix_counts(NS, keys) == ([3, 3], [12, 11])
    assert index.prefix_counts(OTHER, keys) == ([0, 0], [0, 0])
    index.remove(a[1])
    assert index.prefix_counts(NS, keys) == ([1, 0], [4, 0])


def test_prefix_counts_count_a_head_range_write_once_every_range_landed() -> None:
    index = LocalIndex(1)
    first = chain(index, [1])[0]
    ranged = entry(2, 1)
    ranged.shards = object()  # ranks still writing their head ranges
    index.add(ranged)
    chain_keys = [key(1), key(2)]
    assert index.prefix_counts(NS, chain_keys) == ([1], [4])
    ranged.shards = None  # the last range landed (the store clears it, unannounced)
    assert index.prefix_counts(NS, chain_keys) == ([2], [8])
    assert index.prefix_counts(NS, chain_keys) == ([2], [8])
    index.move(first, 0, None)
    assert index.prefix_counts(NS, chain_keys) == ([2], [8])


def test_prefix_counts_with_a_replayed_key_stay_per_namespace() -> None:
    index = LocalIndex(1)
    chain(index, [1, 2])
    squatter = Entry(key(1), ROOT, OTHER, 4, 0, None)
    squatter.ready = READY_ALL
    index.add(squatter)  # the side map is in use: lookups take the slow path
    assert index.prefix_counts(NS, [key(1), key(2)]) == ([2], [8])
    assert index.prefix_counts(OTHER, [key(1), key(2)]) == ([1], [4])
