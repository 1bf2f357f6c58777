"""kvfabric's SGLang HiCache storage backend against a live daemon, created by SGLang's own
storage factory from its wheel, over host pools laid out as SGLang's."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

# 4 KiB daemon pages and 3 KiB layers: layer 0 is one run of a page, layers 1 and 2 straddle
# two pages, so both copy paths of every layout run.
DAEMON = (
    "store.tiers.dram.capacity=16MiB",
    "store.tiers.dram.page_size=4KiB",
    "store.tiers.ssd.capacity=32MiB",
)
GEOMETRY = {"layer_num": 3, "head_num": 2, "head_dim": 96, "page_size": 4}
MLA_GEOMETRY = {"layer_num": 3, "head_dim": 192, "page_size": 4}
LAYOUTS = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
    ("mla", "page_first_direct"),
]


@pytest.fixture(scope="module")
def daemon(start_module_daemon: Any) -> Any:
    return start_module_daemon("sglang", *DAEMON)


@pytest.fixture(autouse=True)
def _helpers(make_pool: Any, page_keys: Any) -> None:
    """The wheel-backed helpers of the conftest (test dirs are not importable packages)."""
    global HostPool, page_hashes
    HostPool, page_hashes = make_pool, page_keys


def pool(kind: str, layout: str, seed: int | None = None) -> Any:
    made = HostPool(
        layout=layout, mla=kind == "mla", **(MLA_GEOMETRY if kind == "mla" else GEOMETRY)
    )
    if seed is not None:
        made.fill_random(seed)
    return made


def keys_for(test: str, pages: int, page_size: int = 4) -> list[str]:
    tokens = [(sum(map(ord, test)) * 7919 + i * 104729) & 0xFFFF for i in range(pages * page_size)]
    return page_hashes(tokens, page_size)


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_zero_copy_round_trip_is_byte_exact(
    daemon: Any, make_backend: Any, kind: str, layout: str
) -> None:
    source, target = pool(kind, layout, seed=1), pool(kind, layout)
    keys = keys_for(f"v1-{kind}-{layout}", 3)
    writer = make_backend(source, daemon.socket, mla=kind == "mla")
    assert writer.batch_set_v1(keys, source.host_indices([2, 5, 7])) == [True] * 3
    reader = make_backend(target, daemon.socket, mla=kind == "mla")
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, target.host_indices([0, 1, 3])) == [True] * 3
    for src, dst in ((2, 0), (5, 1), (7, 3)):
        assert target.page_bytes(dst * 4) == source.page_bytes(src * 4)


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_copying_round_trip_is_byte_exact(
    daemon: Any, make_backend: Any, kind: str, layout: str
) -> None:
    source = pool(kind, layout, seed=2)
    keys = keys_for(f"copy-{kind}-{layout}", 2)
    backend = make_backend(source, daemon.socket, mla=kind == "mla")
    assert backend.batch_set(keys, [source.get_data_page(p * 4) for p in (1, 6)])
    pages = backend.batch_get(keys, [source.get_dummy_flat_data_page() for _ in keys])
    assert [p.view(torch.uint8).numpy().tobytes() for p in pages] == [
        source.page_bytes(4),
        source.page_bytes(24),
    ]
    one = backend.get(keys[1], source.get_dummy_flat_data_page())
    assert one is not None and torch.equal(one, source.get_data_page(24))
    assert backend.set(keys[0], source.get_data_page(4))  # already held: still a success


def test_set_with_a_target_location_stores_a_page_tensor_and_refuses_anything_else(
    daemon: Any, make_backend: Any
) -> None:
    """Regression: on the old code ``set(key, target_location=...)`` (SGLang's signature,
    the form its other backends take) raised ``'NoneType' object has no attribute 'dtype'``
    into SGLang instead of returning False as HiCacheStorage.set promises."""
    source = pool("mha", "page_first", seed=8)
    keys = keys_for("set-target-location", 4)
    backend = make_backend(source, daemon.socket)
    page = source.get_data_page(4)
    assert backend.set(keys[0], target_location=page)  # the page given as the location
    got = backend.get(keys[0], source.get_dummy_flat_data_page())
    assert got is not None and torch.equal(got, page)
    assert backend.set(keys[1], target_location=0x7F00DEAD0000, target_sizes=4096) is False
    assert backend.set(keys[2]) is False  # nothing to store
    assert backend.set(keys[3], torch.zeros(3, dtype=page.dtype)) is False  # not a page
    assert backend.batch_set(keys[1:3], target_locations=[page, source.get_data_page(8)])
    assert backend.batch_set(keys[1:3], [page, None]) is False
    assert backend.batch_exists(keys) == 3  # keys[3] was never stored
    assert backend.get_stats().totals["write_failures"] >= 4


def test_pages_are_shared_across_host_layouts_and_both_interfaces(
    daemon: Any, make_backend: Any
) -> None:
    keys = keys_for("cross-layout", 2)
    first = pool("mha", "layer_first", seed=3)
    assert make_backend(first, daemon.socket).batch_set(keys[:1], [first.get_data_page(8)])
    assert make_backend(first, daemon.socket).batch_set_v1(keys[1:], first.host_indices([9])) == [
        True
    ]
    for layout in ("page_first", "page_first_direct", "page_head"):
        other = pool("mha", layout)
        backend = make_backend(other, daemon.socket)
        assert backend.batch_get_v1(keys, other.host_indices([3, 4])) == [True, True]
        from kvfabric_connectors.sglang.layout import PageLayout

        a, b = PageLayout.of_pool(first, False), PageLayout.of_pool(other, False)
        for src, dst in ((8, 12), (36, 16)):
            assert torch.equal(
                a.canonical(first.get_data_page(src, flat=False)),
                b.canonical(other.get_data_page(dst, flat=False)),
            )


def test_batch_exists_counts_consecutive_hits_from_the_first_key(
    daemon: Any, make_backend: Any
) -> None:
    source = pool("mha", "page_first", seed=4)
    keys = keys_for("prefix", 6)
    backend = make_backend(source, daemon.socket)
    stored = [0, 1, 2, 4]
    assert (
        backend.batch_set_v1([keys[i] for i in stored], source.host_indices(stored)) == [True] * 4
    )
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[4:]) == 1
    assert backend.batch_exists([keys[3], keys[4]]) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[2]) and not backend.exists(keys[5])
    target = pool("mha", "page_first")
    assert make_backend(target, daemon.socket).batch_get_v1(
        keys[2:5], target.host_indices([0, 1, 2])
    ) == [True, False, True]


def test_tenants_and_tp_ranks_never_share_pages(daemon: Any, make_backend: Any) -> None:
    source = pool("mha", "layer_first", seed=5)
    keys = keys_for("separation", 2)
    indices = source.host_indices([0, 1])
    assert make_backend(
        source, daemon.socket, cache_salt="team-a", tp_rank=0, tp_size=2
    ).batch_set_v1(keys, indices) == [True, True]
    same = make_backend(
        pool("mha", "layer_first"), daemon.socket, cache_salt="team-a", tp_rank=0, tp_size=2
    )
    assert same.batch_exists(keys) == 2
    for other in (
        {"cache_salt": "team-b", "tp_rank": 0, "tp_size": 2},
        {"cache_salt": "team-a", "tp_rank": 1, "tp_size": 2},
        {"cache_salt": "team-a", "tp_rank": 0, "tp_size": 1},
        {"cache_salt": "team-a", "tp_rank": 0, "tp_size": 2, "model_name": "other"},
    ):
        target = pool("mha", "layer_first")
        backend = make_backend(target, daemon.socket, **other)
        assert backend.batch_exists(keys) == 0, other
        assert backend.batch_get_v1(keys, target.host_indices([0, 1])) == [False, False]
        assert target.kv_buffer.eq(0).all()


def test_a_missing_daemon_makes_every_call_a_quick_miss(tmp_path: Any, make_backend: Any) -> None:
    source = pool("mha", "page_first", seed=6)
    backend = make_backend(source, str(tmp_path / "no-daemon.sock"))
    keys = keys_for("missing", 2)
    started = time.monotonic()
    assert backend.batch_set_v1(keys, source.host_indices([0, 1])) == [False, False]
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
    assert backend.batch_get_v1(keys, source.host_indices([0, 1])) == [False, False]
    assert backend.get(keys[0], source.get_dummy_flat_data_page()) is None
    assert not backend.set(keys[0], source.get_data_page(0))
    backend.clear()
    assert time.monotonic() - started < 5.0
    assert backend.get_stats().totals["daemon_errors"] >= 1


def test_get_stats_is_sglang_storage_metrics_with_hits_and_bytes(
    daemon: Any, make_backend: Any
) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    source = pool("mha", "page_head", seed=7)
    keys = keys_for("stats", 3)
    backend = make_backend(source, daemon.socket)
    assert backend.batch_set_v1(keys[:2], source.host_indices([0, 1])) == [True, True]
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys[:2], source.host_indices([2, 3])) == [True, True]
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    page_bytes = backend.namespace.spec.chunk_bytes
    assert page_bytes == 3 * 2 * 2 * 4 * 96 * 2
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
    assert all(b > 0 for b in stats.backup_bandwidth + stats.prefetch_bandwidth)
    totals = stats.totals
    assert (totals["queried_pages"], totals["hit_pages"]) == (3, 2)
    assert (totals["written_pages"], totals["written_bytes"]) == (2, 2 * page_bytes)
    assert (totals["read_pages"], totals["read_bytes"]) == (2, 2 * page_bytes)
    again = backend.get_stats()
    assert again.prefetch_pgs == [] and again.backup_pgs == [] and again.totals == totals


def test_clear_deletes_the_pages_this_backend_stored(daemon: Any, make_backend: Any) -> None:
    source = pool("mha", "page_first", seed=8)
    keys = keys_for("clear", 2)
    backend = make_backend(source, daemon.socket)
    assert backend.batch_set_v1(keys, source.host_indices([0, 1])) == [True, True]
    backend.clear()
    assert backend.batch_exists(keys) == 0


def test_bad_configuration_fails_at_creation(daemon: Any, make_backend: Any) -> None:
    with pytest.raises(ValueError, match=r"extra_config\.chunk_tokens: unknown key"):
        make_backend(pool("mha", "page_first"), daemon.socket, chunk_tokens=16)
    with pytest.raises(ValueError, match="host layouts"):
        make_backend(pool("mha", "page_head"), daemon.socket, mla=True)
