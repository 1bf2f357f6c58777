"""A real, small filesystem for disk-fault tests: a tmpfs of a few MiB and a few inodes,
mounted by the test (root or CAP_SYS_ADMIN needed; the test is skipped, saying why, when
the mount is refused), and helpers that fill its blocks or its inodes."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, *, size: str = "8m", inodes: int = 64) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` with ``inodes`` inodes at ``path`` (created if missing)."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={size},nr_inodes={inodes},mode=0700",
            "tmpfs",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs at {path} (needs root or CAP_SYS_ADMIN): "
            f"{(result.stderr or result.stdout).strip()}"
        )
    try:
        yield path
    finally:
        # lazy: a daemon killed by the test may still hold a file open for a moment
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_blocks(directory: Path, name: str = "filler") -> Path:
    """Write a file until the filesystem has no free block left; return its path."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for block in (1 << 16, 4096):  # big steps, then the last pages
            chunk = b"\xa5" * block
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return path


def fill_inodes(directory: Path, prefix: str = "inode-") -> list[Path]:
    """Create empty files until the filesystem has no free inode left; return them."""
    made = []
    for i in range(1 << 16):
        path = directory / f"{prefix}{i}"
        try:
            path.touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(path)
    raise AssertionError(f"{directory} did not run out of inodes")
