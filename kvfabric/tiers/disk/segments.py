"""Segment files of the SSD tier: naming, safe directory handling, header scan and I/O.

A segment is a regular file named ``seg-NNNNNNNN.kvf`` (eight ASCII digits = segment id)
holding records (see records.py) back to back, each starting on an ALIGN boundary.

Path safety: the tier directory is resolved once (symlinks included), checked to stay
inside the configured root (which must be an existing directory), created with mode 0o700
if missing, and opened as a directory fd. Every later file operation is relative to that
fd and uses O_NOFOLLOW, so renaming or symlinking the path afterwards cannot redirect I/O.
Only names matching SEGMENT_PATTERN that are regular files (never symlinks) are opened;
lookalikes are counted and warned about.

Start-up: ``recover`` opens every segment and walks it header to header
(``scan_segment``, payloads unread); a bad header page resynchronises at the next aligned
magic. A record whose span passes the end of file, a partial page, or an all-zero page
where a record should start counts as torn; any other bad header page counts as corrupt.
A file with a segment's name but not one page starting with the record magic is foreign:
it is ignored with a warning (counted with the lookalikes), never written nor deleted.

Thread-safety: SegmentFile I/O is positional (pread/pwrite family) and may run
concurrently. Users pin a file around I/O; ``retire`` closes the fd only once the last
pin is released, so unlinking a segment never pulls the fd from under an in-flight read
(and its number cannot be reused by an unrelated open while that read still uses it).

Errors: bad directory configuration raises ConfigError; I/O failures raise OSError.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.errors import ConfigError, CorruptRecordError, KVFabricError
from kvfabric.tiers.disk.records import (
    ALIGN,
    MAGIC,
    RecordFieldError,
    RecordHeader,
    align_up,
    decode_header,
    payload_checksum,
)

log = logging.getLogger(__name__)

SEGMENT_PATTERN = re.compile(r"seg-([0-9]{8})\.kvf")
MAX_SEGMENT_ID = 99_999_999
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_RESYNC_CHUNK = 1 << 20
_ZERO_PAGE = bytes(ALIGN)


def segment_name(segment_id: int) -> str:
    if not 0 < segment_id <= MAX_SEGMENT_ID:
        raise KVFabricError(f"segment id {segment_id} out of range (1..{MAX_SEGMENT_ID})")
    return f"seg-{segment_id:08d}.kvf"


def _config_path(value: str | os.PathLike[str], what: str) -> str:
    try:
        path = os.fsdecode(os.fspath(value))
    except TypeError as exc:
        raise ConfigError(f"{what} must be a path, got {type(value).__name__}") from exc
    if "\x00" in path:
        raise ConfigError(f"{what} {path!r} contains a NUL byte")
    if not path:
        raise ConfigError(f"{what} is empty")
    return path


def open_directory(
    directory: str | os.PathLike[str], root: str | os.PathLike[str] | None
) -> tuple[Path, int]:
    """Resolve, validate, create (0o700) and open the tier directory; return (path, dir fd)."""
    raw = _config_path(directory, "disk tier directory")
    base: Path | None = None
    if root is None:
        target = Path(os.path.realpath(raw))
    else:
        base = Path(os.path.realpath(_config_path(root, "disk tier root")))
        if not base.is_dir():
            raise ConfigError(f"disk tier root {base} is not an existing directory")
        # join() lets an absolute `raw` replace base; realpath then resolves every symlink,
        # so the containment check below sees where the directory really is.
        target = Path(os.path.realpath(os.path.join(base, raw)))
        if not target.is_relative_to(base):
            raise ConfigError(
                f"disk tier directory {raw!r} resolves to {target}, outside root {base}"
            )
    if target.exists() and not target.is_dir():
        raise ConfigError(f"disk tier directory {target} exists and is not a directory")
    try:
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot create or open disk tier directory {target}: {exc}") from exc
    # Re-check what was opened: a symlink swapped in during creation would resolve elsewhere.
    now = Path(os.path.realpath(target))
    opened = os.fstat(fd)
    try:
        same = os.path.samestat(opened, os.stat(now))
    except OSError:
        same = False
    if not same or now != target or (base is not None and not now.is_relative_to(base)):
        os.close(fd)
        raise ConfigError(f"disk tier directory {target} changed while it was being opened")
    return target, fd


@dataclass(frozen=True)
class SegmentListing:
    ids: tuple[int, ...]  # openable candidates, ascending
    ignored: int  # lookalike names, symlinks and non-regular files skipped
    max_id: int  # highest id any entry uses, so a new segment never collides


def list_segments(dir_fd: int) -> SegmentListing:
    ids: list[int] = []
    ignored = 0
    max_id = 0
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            match = SEGMENT_PATTERN.fullmatch(entry.name)
            if match is None:
                if entry.name.startswith("seg-") and entry.name.endswith(".kvf"):
                    log.warning("ignoring stray file %r in disk tier directory", entry.name)
                    ignored += 1
                continue
            segment_id = int(match.group(1))
            max_id = max(max_id, segment_id)
            if entry.is_symlink() or not entry.is_file(follow_symlinks=False) or segment_id == 0:
                log.warning("refusing to open %r: not a regular segment file", entry.name)
                ignored += 1
                continue
            ids.append(segment_id)
    return SegmentListing(tuple(sorted(ids)), ignored, max_id)


def remove_segment(dir_fd: int, segment_id: int) -> None:
    os.unlink(segment_name(segment_id), dir_fd=dir_fd)


def byte_views(pieces: Sequence[Any], *, writable: bool) -> list[memoryview]:
    """Flat unsigned-byte views of buffer pieces (memoryview, numpy array, bytes...), no copy."""
    views = []
    for piece in pieces:
        view = memoryview(piece)
        if not view.c_contiguous:
            raise RecordFieldError("buffer pieces must be C-contiguous")
        if writable and view.readonly:
            raise RecordFieldError("read buffers must be writable")
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


def _vectored(
    op: Callable[[int, Sequence[Any], int], int], fd: int, views: Sequence[memoryview], offset: int
) -> int:
    """Run preadv/pwritev over ``views`` in IOV_MAX batches, resuming after short transfers.

    Returns the bytes moved; less than requested only when a read hits end of file.
    """
    bufs = [v for v in views if len(v)]
    total = i = 0
    while i < len(bufs):
        moved = op(fd, bufs[i : i + _IOV_MAX], offset)
        if moved == 0:
            break
        total += moved
        offset += moved
        while moved:
            if moved >= len(bufs[i]):
                moved -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][moved:]
                moved = 0
    return total


class SegmentFile:
    """An open segment file with a pin count; see the module docstring for the fd lifetime."""

    def __init__(self, segment_id: int, fd: int) -> None:
        self.segment_id = segment_id
        self._fd = fd
        self._lock = threading.Lock()
        self._pins = 0
        self._retired = False
        self.closed = False

    @classmethod
    def open(cls, dir_fd: int, segment_id: int, *, create: bool = False) -> SegmentFile:
        # O_NONBLOCK: a FIFO swapped in after listing must fail the type check, not hang us.
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        name = segment_name(segment_id)
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "segment is not a regular file", name)
        return cls(segment_id, fd)

    def pin(self) -> None:
        with self._lock:
            if self._retired:
                raise KVFabricError(f"segment {self.segment_id} is retired")
            self._pins += 1

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            self._close_if_idle()

    def retire(self) -> None:
        """Refuse new pins; close the fd as soon as no pin is held. Idempotent."""
        with self._lock:
            self._retired = True
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._retired and self._pins == 0 and not self.closed:
            self.closed = True
            os.close(self._fd)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read(self, n: int, offset: int) -> bytes:
        return os.pread(self._fd, n, offset)

    def readv(self, views: Sequence[memoryview], offset: int) -> int:
        return _vectored(os.preadv, self._fd, views, offset)

    def writev(self, views: Sequence[memoryview], offset: int) -> None:
        expected = sum(len(v) for v in views)
        if _vectored(os.pwritev, self._fd, views, offset) != expected:
            raise OSError(errno.EIO, f"short write to segment {self.segment_id}")

    def write_byte(self, value: int, offset: int) -> None:
        if os.pwrite(self._fd, bytes((value,)), offset) != 1:
            raise OSError(errno.EIO, f"short write to segment {self.segment_id}")

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def allocate(self, offset: int, length: int) -> None:
        """Reserve real blocks (ENOSPC / EDQUOT if there is no room); see DiskTier.probe."""
        os.posix_fallocate(self._fd, offset, length)


@dataclass(frozen=True)
class ScannedRecord:
    offset: int
    header: RecordHeader


@dataclass(frozen=True)
class SegmentScan:
    records: tuple[ScannedRecord, ...]  # decodable headers whose span fits in the file
    corrupt: int  # header pages that failed to decode
    torn: int  # records cut short, holes left by writes that never landed
    file_size: int


def scan_segment(seg: SegmentFile) -> SegmentScan:
    """Walk a segment header to header (payloads are not read or verified).

    On a bad header page, resynchronise at the next ALIGN boundary carrying the magic so
    one damaged record does not hide the rest of the segment.
    """
    end = seg.size()
    records: list[ScannedRecord] = []
    corrupt = torn = 0
    offset = 0
    while offset < end:
        page = seg.read(ALIGN, offset)
        if len(page) < ALIGN:
            torn += 1
            break
        try:
            header = decode_header(page)
        except CorruptRecordError as exc:
            if page == _ZERO_PAGE:
                torn += 1  # a hole: a later record landed but this one never did
            else:
                corrupt += 1
                log.warning(
                    "segment %d offset %d: %s; resynchronising", seg.segment_id, offset, exc
                )
            offset = _next_magic(seg, offset + ALIGN, end)
            continue
        if offset + header.span > end:
            torn += 1
            break
        records.append(ScannedRecord(offset, header))
        offset += header.span
    return SegmentScan(tuple(records), corrupt, torn, end)


def _next_magic(seg: SegmentFile, start: int, end: int) -> int:
    """First ALIGN boundary >= start whose page begins with the record magic, else end."""
    pos = start
    while pos < end:
        chunk = seg.read(min(_RESYNC_CHUNK, end - pos), pos)
        if not chunk:
            break
        hit = chunk.find(MAGIC)
        while hit != -1:
            if hit % ALIGN == 0:  # chunks start aligned, so this is an aligned file offset
                return pos + hit
            hit = chunk.find(MAGIC, align_up(hit))
        pos += len(chunk)
    return end


@dataclass(frozen=True)
class OpenedSegment:
    file: SegmentFile
    scan: SegmentScan
    live: tuple[ScannedRecord, ...]  # the LIVE records kept (winners), in offset order


@dataclass(frozen=True)
class Recovery:
    """The outcome of opening and scanning every segment of a directory."""

    segments: tuple[OpenedSegment, ...]  # non-empty segments, ascending id
    losers: tuple[tuple[SegmentFile, ScannedRecord], ...]  # superseded LIVE duplicates
    ignored: int
    max_id: int
    max_seq: int


def _payload_intact(seg: SegmentFile, rec: ScannedRecord) -> bool:
    """Whether the record's payload matches its header's checksum (read in bounded chunks;
    a payload cut short by the end of file hashes short and fails)."""

    def chunks() -> Iterator[bytes]:
        offset, end = rec.offset + ALIGN, rec.offset + ALIGN + rec.header.payload_len
        while offset < end:
            chunk = seg.read(min(_RESYNC_CHUNK, end - offset), offset)
            if not chunk:
                return
            yield chunk
            offset += len(chunk)

    return payload_checksum(chunks()) == rec.header.payload_checksum


def recover(dir_fd: int) -> Recovery:
    """Open and scan every segment; choose one LIVE record per key.

    Duplicates: the newest intact record wins: the highest write sequence (a compaction copy
    keeps its original's sequence, so it never beats a newer write), then the higher segment
    id, then offset, skipping any whose payload fails its checksum (only duplicates are read:
    a torn newer record was never acknowledged, the older one is what was). Empty segment
    files (created just before a crash) are removed.
    """
    listing = list_segments(dir_fd)
    ignored = listing.ignored
    scans: list[tuple[SegmentFile, SegmentScan]] = []
    for segment_id in listing.ids:
        try:
            file = SegmentFile.open(dir_fd, segment_id)
        except OSError as exc:
            log.warning("ignoring segment %d: %s", segment_id, exc)
            ignored += 1
            continue
        try:
            result = scan_segment(file)
        except OSError as exc:  # unreadable: leave it be rather than fail the start-up
            log.warning("ignoring segment %d: %s", segment_id, exc)
            file.retire()
            ignored += 1
            continue
        if result.file_size == 0:
            file.retire()
            remove_segment(dir_fd, segment_id)
        elif not result.records and _next_magic(file, 0, result.file_size) == result.file_size:
            # not a single record page: a foreign file under our name. Never used (as a
            # mostly-dead segment, compaction would unlink it) and never deleted.
            log.warning(
                "ignoring %r: not a segment (no record in %d bytes)",
                segment_name(segment_id),
                result.file_size,
            )
            file.retire()
            ignored += 1
        else:
            scans.append((file, result))
    candidates: dict[bytes, list[tuple[tuple[int, int, int], SegmentFile, ScannedRecord]]] = {}
    for file, result in scans:
        for rec in result.records:
            if rec.header.live:
                rank = (rec.header.seq, file.segment_id, rec.offset)
                candidates.setdefault(rec.header.key, []).append((rank, file, rec))
    best: dict[bytes, tuple[SegmentFile, ScannedRecord]] = {}
    losers: list[tuple[SegmentFile, ScannedRecord]] = []
    for key, found in candidates.items():
        found.sort(key=lambda c: c[0], reverse=True)
        # Rare (a crash mid-compaction, an overwrite): the winner must be whole. A copy torn
        # by the crash can lie inside the file (a later record landed past it) and would
        # otherwise beat its intact original, which is then marked DEAD: the object lost.
        chosen = 0
        if len(found) > 1:
            chosen = next((i for i, (_, f, r) in enumerate(found) if _payload_intact(f, r)), 0)
        best[key] = (found[chosen][1], found[chosen][2])
        losers.extend((f, r) for i, (_, f, r) in enumerate(found) if i != chosen)
    kept = {(f.segment_id, r.offset) for f, r in best.values()}
    segments = tuple(
        OpenedSegment(
            file, result, tuple(r for r in result.records if (file.segment_id, r.offset) in kept)
        )
        for file, result in scans
    )
    max_seq = max((r.header.seq for _, res in scans for r in res.records), default=0)
    return Recovery(segments, tuple(losers), ignored, listing.max_id, max_seq)
