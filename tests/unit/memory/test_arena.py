"""SharedArena: geometry checks, page views, and a second process reading in place."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvfabric.memory import numa
from kvfabric.memory.arena import SharedArena

PAGE = 64 * 1024


def test_geometry_is_validated() -> None:
    with pytest.raises(ValueError, match="page_size"):
        SharedArena.create(1 << 20, 1000)
    with pytest.raises(ValueError, match="multiple of page_size"):
        SharedArena.create(PAGE * 3 + 4096, PAGE)


def test_pages_are_disjoint_views_of_one_region() -> None:
    with SharedArena.create(PAGE * 4, PAGE, prefault=True) as arena:
        assert arena.num_pages == 4
        arena.page(2)[:] = 7
        assert arena.array[2 * PAGE:3 * PAGE].min() == 7
        assert arena.array[:2 * PAGE].max() == 0
        with pytest.raises(IndexError):
            arena.page(4)


def test_second_process_maps_the_arena_and_reads_zero_copy() -> None:
    """The child maps the memfd it inherited, checks our bytes, and writes into page 1."""
    arena = SharedArena.create(PAGE * 4, PAGE)
    try:
        payload = np.random.default_rng(1).integers(0, 256, PAGE + 100, dtype=np.uint8)
        arena.array[:payload.size] = payload  # an "object" spanning pages 0 and 1
        child = textwrap.dedent(f"""
            import hashlib, sys
            from kvfabric.memory.arena import SharedArena
            arena = SharedArena.attach({arena.fd}, {arena.size}, {arena.page_size})
            view = arena.array[:{payload.size}]
            print(hashlib.sha256(view).hexdigest())
            arena.page(3)[:16] = 0xAB  # written in place, seen by the parent
        """)
        out = subprocess.run([sys.executable, "-c", child], pass_fds=(arena.fd,),
                             capture_output=True, text=True, check=True, timeout=60)
        import hashlib
        assert out.stdout.strip() == hashlib.sha256(payload.tobytes()).hexdigest()
        assert (arena.page(3)[:16] == 0xAB).all()
    finally:
        arena.close()


def test_attach_refuses_a_short_fd() -> None:
    fd = os.memfd_create("short")
    os.ftruncate(fd, PAGE)
    with pytest.raises(ValueError, match="expected"):
        SharedArena.attach(fd, PAGE * 2, PAGE)
    os.close(fd)


def test_numa_binding_to_a_real_node_and_graceful_degradation(caplog) -> None:
    node = numa.available_nodes()[0]
    with SharedArena.create(PAGE * 2, PAGE, numa_node=node) as arena:
        assert arena.numa_node == node  # mbind really ran on this node
        arena.array[:] = 1
    with caplog.at_level(logging.WARNING):
        with SharedArena.create(PAGE * 2, PAGE, numa_node=999) as arena:
            assert arena.numa_node is None
            arena.array[:] = 2  # still plain, usable memory
            assert arena.array.sum() == 2 * arena.size
    assert "does not exist" in caplog.text


def test_close_with_live_views_does_not_crash() -> None:
    arena = SharedArena.create(PAGE, PAGE)
    view = arena.page(0)
    arena.close()
    arena.close()  # idempotent
    view[:4] = 1  # the mapping lives as long as the view
    assert view[:4].sum() == 4
