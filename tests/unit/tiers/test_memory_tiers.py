"""Paged memory tiers: DRAM / CXL arenas and the torch device pool (``cpu`` here)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from kvfabric.errors import CapacityError
from kvfabric.tiers.base import TierKind
from kvfabric.tiers.device import DeviceTier
from kvfabric.tiers.host import HostTier

PAGE = 4096


def test_device_tier_is_one_torch_pool_on_cpu_cut_into_pages() -> None:
    tier = DeviceTier("device", 4 * PAGE + 100, PAGE)  # a partial page is not capacity
    assert tier.device == torch.device("cpu") and tier.capacity_bytes == 4 * PAGE
    pages = tier.allocate(2 * PAGE + 1)
    assert len(pages) == 3 and tier.used_bytes == 3 * PAGE
    pieces = tier.pieces(pages, 10, 2 * PAGE)
    assert all(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in pieces)
    assert sum(p.numel() for p in pieces) == 2 * PAGE
    pool = tier._pool
    pool_end = pool.data_ptr() + pool.numel()
    assert all(pool.data_ptr() <= p.data_ptr() < pool_end for p in pieces)  # views, no copy
    data = torch.arange(2 * PAGE, dtype=torch.int64).to(torch.uint8)
    offset = 0
    for piece in pieces:
        piece.copy_(data[offset : offset + piece.numel()])
        offset += piece.numel()
    assert torch.equal(torch.cat(tier.pieces(pages, 10, 2 * PAGE)), data)
    with pytest.raises(CapacityError):
        tier.allocate(2 * PAGE)  # one page left
    assert tier.used_bytes == 3 * PAGE  # a refused allocation takes nothing
    tier.free(pages)
    assert tier.used_bytes == 0 and len(tier.allocate(4 * PAGE)) == 4
    tier.close()


def test_host_tier_pieces_are_views_of_its_shared_arena() -> None:
    tier = HostTier("dram", TierKind.DRAM, 3 * PAGE, PAGE)
    try:
        pages = tier.allocate(PAGE + 5)
        pieces = tier.pieces(pages, 0, PAGE + 5)
        assert [p.nbytes for p in pieces] == [PAGE, 5]
        assert all(np.shares_memory(p, tier.arena.array) for p in pieces)
    finally:
        tier.close()


def test_cxl_tier_without_its_numa_node_is_plain_memory_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        tier = HostTier("cxl", TierKind.CXL, 2 * PAGE, PAGE, numa_node=999)
    try:
        assert tier.arena.numa_node is None and tier.kind is TierKind.CXL
        (piece,) = tier.pieces(tier.allocate(PAGE), 0, PAGE)
        piece[:] = 7
        assert int(piece.sum()) == 7 * PAGE
    finally:
        tier.close()
    assert "does not exist" in caplog.text


def test_a_host_tier_is_dram_or_cxl() -> None:
    for kind in (TierKind.SSD, TierKind.DEVICE):
        with pytest.raises(ValueError, match="dram or cxl"):
            HostTier("x", kind, PAGE, PAGE)


def test_a_tenant_pool_is_an_arena_of_its_own_within_the_tiers_one_budget() -> None:
    """Regression: on the old code a host tier had one arena for every tenant, so any client
    handed its descriptor could read and overwrite every tenant's objects."""
    tier = HostTier("dram", TierKind.DRAM, 4 * PAGE, PAGE)
    try:
        tier.add_pool("team-a", 2 * PAGE)
        assert tier.pool_of("team-a") == "team-a" and tier.pool_of("team-b") is None
        mine = tier.allocate(2 * PAGE, "team-a")
        shared = tier.allocate(PAGE)
        assert mine.pool == "team-a" and list(mine) == [0, 1]  # ids are per pool
        for piece in tier.pieces(mine, 0, 2 * PAGE):
            assert np.shares_memory(piece, tier.arenas["team-a"].array)
            assert not np.shares_memory(piece, tier.arena.array)
        assert tier.arenas["team-a"].fd != tier.arena.fd
        with pytest.raises(CapacityError):  # the pool is full (its size is its quota)
            tier.allocate(PAGE, "team-a")
        tier.allocate(PAGE)
        with pytest.raises(CapacityError):  # the tier's budget is spent across pools
            tier.allocate(PAGE)
        assert tier.used_bytes == tier.capacity_bytes == 4 * PAGE
        tier.free(mine)
        tier.free(shared)
        assert tier.used_bytes == PAGE and len(tier.allocate(2 * PAGE, "team-a")) == 2
    finally:
        tier.close()


def test_free_memory_goes_back_to_the_os_but_the_most_recently_freed_stays() -> None:
    """Regression: on the old code pages freed by an eviction kept their memory for good
    (the daemon's RSS stayed at its peak after evict-all)."""
    tier = HostTier("dram", TierKind.DRAM, 8 * PAGE, PAGE)
    try:
        pages = tier.allocate(8 * PAGE)
        for piece in tier.pieces(pages, 0, 8 * PAGE):
            piece[:] = 1
        blocks = os.fstat(tier.arena.fd).st_blocks
        tier.free(pages)
        assert tier.release_free_memory(keep_bytes=2 * PAGE) == 6 * PAGE
        assert os.fstat(tier.arena.fd).st_blocks <= blocks * 2 // 8 + 8
        assert tier.release_free_memory(keep_bytes=2 * PAGE) == 0  # nothing new to give back
        assert tier.release_free_memory(keep_bytes=0) == 2 * PAGE
        assert os.fstat(tier.arena.fd).st_blocks == 0
    finally:
        tier.close()
