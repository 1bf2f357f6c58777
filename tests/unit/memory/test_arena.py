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
        assert arena.array[2 * PAGE : 3 * PAGE].min() == 7
        assert arena.array[: 2 * PAGE].max() == 0
        with pytest.raises(IndexError):
            arena.page(4)


def test_second_process_maps_the_arena_and_reads_zero_copy() -> None:
    """The child maps the memfd it inherited, checks our bytes, and writes into page 1."""
    arena = SharedArena.create(PAGE * 4, PAGE)
    try:
        payload = np.random.default_rng(1).integers(0, 256, PAGE + 100, dtype=np.uint8)
        arena.array[: payload.size] = payload  # an "object" spanning pages 0 and 1
        child = textwrap.dedent(f"""
            import hashlib, sys
            from kvfabric.memory.arena import SharedArena
            arena = SharedArena.attach({arena.fd}, {arena.size}, {arena.page_size})
            view = arena.array[:{payload.size}]
            print(hashlib.sha256(view).hexdigest())
            arena.page(3)[:16] = 0xAB  # written in place, seen by the parent
        """)
        out = subprocess.run(
            [sys.executable, "-c", child],
            pass_fds=(arena.fd,),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
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


def test_the_region_cannot_be_resized_by_anyone_who_holds_its_descriptor() -> None:
    """Regression: on the old code the memfd was unsealed, so a client that received it
    could ftruncate it; new clients then failed to map it and the daemon died of SIGBUS at
    its next touch of the cut pages (0 of 40 chunks survived)."""
    with SharedArena.create(PAGE * 4, PAGE) as arena:
        arena.array[:] = 5
        fd = os.dup(arena.fd)  # what a client gets through SCM_RIGHTS: the same file
        try:
            for size in (0, PAGE, PAGE * 8):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            import fcntl

            with pytest.raises(PermissionError):  # no seal can be added (or removed) either
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(fd)
        assert os.fstat(arena.fd).st_size == PAGE * 4
        assert int(arena.array.sum()) == 5 * PAGE * 4  # every page still there


def test_a_read_only_descriptor_maps_read_only() -> None:
    """A reader's descriptor gives no way to write: no writable shared mapping, no write(2)."""
    with SharedArena.create(PAGE * 2, PAGE) as arena:
        arena.array[:8] = 9
        fd = arena.read_only_fd()
        reader = SharedArena.attach(fd, arena.size, PAGE, writable=False)
        try:
            assert reader.array[:8].tolist() == [9] * 8
            assert not reader.array.flags.writeable
            with pytest.raises(PermissionError):
                SharedArena.attach(os.dup(fd), arena.size, PAGE, writable=True)
            with pytest.raises(OSError):
                os.write(fd, b"x")
            arena.array[:8] = 3  # the owner's writes show through the reader's mapping
            assert reader.array[:8].tolist() == [3] * 8
        finally:
            reader.close()


def test_a_read_only_descriptor_cannot_be_reopened_writable_through_proc() -> None:
    """Even by a process of the daemon's own (non-root) user: the memfd's mode is 0400.
    A forked child drops to an unprivileged user (root bypasses file modes), creates an
    arena and tries to reopen its read-only descriptor for writing."""
    import ctypes
    import json

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's teardown
        outcome = "error"
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                # a uid change makes /proc/self root's; the daemon's own process is dumpable
                ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
            arena = SharedArena.create(PAGE * 2, PAGE)
            fd = arena.read_only_fd()
            try:
                os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
                outcome = "reopened"
            except PermissionError:
                outcome = "refused"
        except BaseException as exc:
            outcome = f"error: {exc!r}"
        finally:
            os.write(write_end, json.dumps(outcome).encode())
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as pipe:
        outcome = json.loads(pipe.read())
    assert outcome == "refused"


def test_release_gives_the_memory_back_and_leaves_zeros() -> None:
    with SharedArena.create(PAGE * 8, PAGE) as arena:
        arena.array[:] = 1
        before = os.fstat(arena.fd).st_blocks
        arena.release(2 * PAGE, 4 * PAGE)
        assert os.fstat(arena.fd).st_blocks < before  # the file holds fewer blocks
        assert arena.array[2 * PAGE : 6 * PAGE].max() == 0
        assert arena.array[: 2 * PAGE].min() == 1 and arena.array[6 * PAGE :].min() == 1
        with pytest.raises(ValueError, match="page-aligned"):
            arena.release(1, PAGE)
