"""DiskTier: the SSD tier of kvfabric.

Contract:
- Storage is a directory of append-only segment files (segments.py) holding
  self-describing, checksummed, 4 KiB-aligned records (records.py). The tier keeps no key
  index ("index-free"): the owner keeps one DiskExtent per object, and ``scan()`` rebuilds
  the live set from the record headers after a restart.
- ``write`` reserves the record's offset under the lock at submit time and hands the I/O
  (one pwritev of header page + caller pieces + padding, no payload copy) to a pool of
  writer threads. ``read_into`` preadv's straight into caller buffers and verifies the
  payload checksum; a corrupt or torn record is counted, marked DEAD and never served.
  Reads go in batches of ``HASH_BATCH`` bytes, each hashed right after its preadv while it
  is still in the CPU cache, instead of a second pass over the whole payload from memory.
- Accounting: used = segment space occupied by records (live, dead, or damaged) in
  existing segments; it only shrinks when compaction unlinks a segment. Compaction copies
  bypass the capacity check (they free more than they take).
- ``delete`` writes the DEAD state byte in place. ``compact`` copies the LIVE records of
  mostly-dead sealed segments to the active segment, lets the owner switch extents, then
  unlinks the old segment; its fd closes when in-flight reads finish. A segment is compacted
  only once every write into it has resolved its future and run the future's done
  callbacks: an owner learns a record's extent in a done callback, so ``relocate`` is never
  asked about a record its owner has not heard of. An owner that takes results later (a
  ``result()`` call) must answer ``relocate`` for its writes still in flight as its own.
- Duplicate LIVE keys at scan: the last intact write wins (see segments.recover: highest
  write sequence, then segment id, then offset, passing over any whose payload fails its
  checksum); the losers are marked DEAD on disk.
- Segment ids: the next id follows the highest name in the directory; past the last id
  (99999999) allocation wraps to the lowest free id, so a stray high-numbered file cannot
  wedge the tier. A failed creation consumes no id; a name a stray file holds is skipped.
- Write faults (health.py): an OSError while creating a segment, writing a record or marking
  one DEAD puts the tier in the DEGRADED state: ``write`` raises TierDegradedError at once
  (the owner evicts instead of demoting), compaction stops, reads go on. A failed record
  gives its reservation back: trailing failed spans of a segment are truncated away once its
  in-flight writes finish (one in the middle stays as dead bytes), so ``used_bytes`` counts
  only what occupies the segments and a full disk burns neither ids nor capacity.
  ``probe`` (on the owner's maintenance tick, at most every ``retry_interval_s``) reserves
  real room (posix_fallocate, then truncated back) and clears the state when it succeeds.

Thread-safety: every public method may be called from any thread. ``_lock`` guards the
offsets, accounting and segment table and is never held across payload I/O or a callback.
``_state_lock`` serialises state-byte transitions (so delete is idempotent).
``_compact_lock`` admits one compaction at a time and makes close() wait for it.

Errors: ConfigError (bad arguments, hostile paths), CapacityError (raised synchronously by
write), TierDegradedError (raised synchronously by write while degraded, or on the write
future when the write itself failed), RecordFieldError (bad key/meta/pieces; a ValueError),
CorruptRecordError (failed checksum or structure at read, or a read that failed with an
I/O error), StaleExtentError (the extent no longer names a live record: deleted, compacted
away, or never valid), KVFabricError (use before scan / after close). A failed delete is
counted (and degrades the tier), not raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import xxhash

from kvfabric.errors import CapacityError, ConfigError, CorruptRecordError, KVFabricError
from kvfabric.tiers.disk.health import (
    DEFAULT_LOG_INTERVAL_S,
    DEFAULT_RETRY_INTERVAL_S,
    DiskHealth,
)
from kvfabric.tiers.disk.records import (
    ALIGN,
    DEAD,
    MAGIC,
    STATE_OFFSET,
    RecordFieldError,
    RecordHeader,
    align_up,
    decode_header,
    encode_header,
    payload_checksum,
    record_span,
    validate_fields,
)
from kvfabric.tiers.disk.segments import (
    MAX_SEGMENT_ID,
    SegmentFile,
    byte_views,
    open_directory,
    recover,
    remove_segment,
    scan_segment,
)

if TYPE_CHECKING:
    import numpy as np

    Piece = memoryview | np.ndarray

log = logging.getLogger(__name__)

_ZERO_PAGE = memoryview(bytes(ALIGN))
# Bytes read per preadv then hashed at once: well inside a core's L2 cache, so the hash reads
# what the read just wrote from cache; large enough that the extra syscalls cost nothing.
HASH_BATCH = 512 * 1024
# A probe of a degraded tier reserves at least this much (and at most a segment): room for
# one small record is not yet room to resume demoting.
PROBE_BYTES = 1 << 20


class StaleExtentError(KVFabricError, LookupError):
    """The extent no longer names a live record (deleted, compacted away, or never valid)."""

    kind = "stale_extent"


class TierDegradedError(KVFabricError):
    """The tier is degraded by a write fault (full disk, quota, I/O error): no new records."""

    kind = "tier_degraded"


@dataclass(frozen=True)
class DiskExtent:
    """Where one record lives."""

    segment_id: int
    offset: int  # record start in the segment file
    payload_offset: int  # absolute file offset of the payload
    payload_len: int

    @property
    def span(self) -> int:
        return self.payload_offset - self.offset + align_up(self.payload_len)


@dataclass(frozen=True)
class RecoveredRecord:
    key: bytes
    meta: bytes
    extent: DiskExtent


@dataclass(frozen=True)
class DiskTierStats:
    capacity_bytes: int
    used_bytes: int
    live_bytes: int
    dead_bytes: int
    segments: int
    records_live: int
    corrupt_records: int  # skipped at scan or refused at read (bad checksum, bad header)
    torn_records: int  # cut short by a crash, or holes left by writes that never landed
    writes: int
    reads: int
    bytes_written: int
    bytes_read: int
    compactions: int
    ignored_files: int = 0  # lookalike names / symlinks in the directory that were not opened
    degraded: bool = False  # a write fault stopped new records (see health.py)
    disk_errors: dict[str, int] = field(default_factory=dict)  # by errno name, reads included


@dataclass(slots=True, eq=False)
class _Segment:
    """Mutable accounting of one open segment; guarded by DiskTier._lock."""

    file: SegmentFile
    size: int = 0  # bytes occupied (for the active segment: reserved so far)
    live: int = 0  # bytes of LIVE records
    records: int = 0  # LIVE records
    writing: int = 0  # writes in flight; compaction leaves the segment alone until 0
    retired: bool = False
    failed: list[tuple[int, int]] = field(default_factory=list)  # (offset, span) to give back


class DiskTier:
    """SSD tier over append-only segment files; see the module docstring for the contract."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        segment_bytes: int = 256 << 20,
        writers: int = 1,
        fsync: bool = False,
        root: str | os.PathLike[str] | None = None,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
    ) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if segment_bytes <= 0 or segment_bytes % ALIGN:
            raise ConfigError(
                f"segment_bytes must be a positive multiple of {ALIGN}, got {segment_bytes}"
            )
        if writers < 1:
            raise ConfigError(f"writers must be >= 1, got {writers}")
        self.path, self._dir_fd = open_directory(directory, root)
        self._capacity = capacity_bytes
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="kvfabric-disk")
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._compact_lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._pending: set[Future[None]] = set()
        self._scan_started = self._ready = self._closed = False
        self._next_id = self._next_seq = 1
        self._used = self._live = self._records = 0
        self._corrupt = self._torn = self._ignored = 0
        self._writes = self._reads = self._bytes_written = self._bytes_read = self._compactions = 0
        self._health = DiskHealth(
            str(self.path), retry_interval_s=retry_interval_s, log_interval_s=log_interval_s
        )
        self._taken_ids: set[int] = set()  # names a stray file holds: never created over

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def degraded(self) -> bool:
        """Whether a write fault stopped new records (a plain read: no lock, any thread)."""
        return self._health.degraded

    # ---- start-up -------------------------------------------------------------------

    def scan(self) -> list[RecoveredRecord]:
        with self._compact_lock:  # close() waits for a scan in progress
            with self._lock:
                if self._closed:
                    raise KVFabricError("disk tier is closed")
                if self._scan_started:
                    raise KVFabricError("DiskTier.scan() may only be called once")
                self._scan_started = True
            found = recover(self._dir_fd)
            for file, rec in found.losers:
                try:
                    file.write_byte(DEAD, rec.offset + STATE_OFFSET)
                    if self._fsync:
                        file.sync()
                except OSError as exc:  # the duplicate is still ignored: the winner is indexed
                    with self._lock:
                        self._health.failed_write(exc, "marking a superseded record DEAD")
            segments: dict[int, _Segment] = {}
            recovered = []
            for opened in found.segments:
                st = _Segment(opened.file, size=align_up(opened.scan.file_size))
                segments[opened.file.segment_id] = st
                for rec in opened.live:
                    st.live += rec.header.span
                    st.records += 1
                    extent = DiskExtent(
                        st.file.segment_id, rec.offset, rec.offset + ALIGN, rec.header.payload_len
                    )
                    recovered.append(RecoveredRecord(rec.header.key, rec.header.meta, extent))
            corrupt = sum(opened.scan.corrupt for opened in found.segments)
            torn = sum(opened.scan.torn for opened in found.segments)
            if corrupt or torn or found.losers:
                log.warning(
                    "disk tier scan: %d corrupt, %d torn, %d superseded records",
                    corrupt,
                    torn,
                    len(found.losers),
                )
            with self._lock:
                self._segments = segments
                self._used = sum(st.size for st in segments.values())
                self._live = sum(st.live for st in segments.values())
                self._records = len(recovered)
                self._corrupt, self._torn, self._ignored = corrupt, torn, found.ignored
                # Always append to a fresh segment: never after a possibly torn tail.
                self._next_id = found.max_id + 1
                self._next_seq = found.max_seq + 1
                self._ready = True
            return recovered

    # ---- writes ---------------------------------------------------------------------

    def write(self, key: bytes, meta: bytes, pieces: Sequence[Piece]) -> Future[DiskExtent]:
        return self._append(key, meta, byte_views(pieces, writable=False), seq=None)

    def _append(
        self, key: bytes, meta: bytes, views: list[memoryview], *, seq: int | None
    ) -> Future[DiskExtent]:
        """Reserve space and queue the record; ``seq`` is given only for compaction copies."""
        payload_len = sum(len(v) for v in views)
        validate_fields(key, meta, payload_len)
        span = record_span(len(meta), payload_len)
        with self._lock:
            self._check_ready()
            if self._health.degraded:
                raise TierDegradedError(
                    f"disk tier {self.path} is degraded ({self._health.reason}): no new records"
                )
            # Compaction copies may overshoot capacity transiently: they free more than they take.
            if seq is None and self._used + span > self._capacity:
                raise CapacityError(
                    f"disk tier full: {self._used} used + {span} needed"
                    f" > {self._capacity} capacity bytes"
                )
            st = self._active
            if st is None or (st.size and st.size + span > self._segment_bytes):
                st = self._new_segment()
            offset = st.size
            st.size += span
            st.live += span
            st.records += 1
            st.writing += 1
            self._used += span
            self._live += span
            self._records += 1
            if seq is None:
                seq = self._next_seq
                self._next_seq += 1
            st.file.pin()
            # the tier resolves the future itself, before the segment's write count drops:
            # see _write_record
            future: Future[DiskExtent] = Future()
            future.set_running_or_notify_cancel()  # the space is reserved: not cancellable
            # flush() and close() wait for the writer's whole turn, callbacks and count included
            settled = self._pool.submit(
                self._write_record, future, st, offset, key, meta, views, seq
            )
            self._pending.add(settled)
        settled.add_done_callback(self._forget)
        return future

    def _new_segment(self) -> _Segment:
        """Open the next segment file and make it active; called with _lock held (rare).

        An id is consumed only by a file that was created: a failure (no space, no inodes)
        degrades the tier and raises TierDegradedError, and the next try reuses the id.
        """
        for _ in range(1024):  # bounded: each turn marks one stray name as taken
            segment_id = self._candidate_id()
            try:
                file = SegmentFile.open(self._dir_fd, segment_id, create=True)
            except FileExistsError:  # a stray entry holds that name: skip it for good
                self._taken_ids.add(segment_id)
                continue
            except OSError as exc:
                self._health.failed_write(exc, f"creating segment {segment_id}")
                raise TierDegradedError(f"cannot create segment {segment_id}: {exc}") from exc
            if self._fsync:
                try:
                    os.fsync(self._dir_fd)
                except OSError as exc:
                    file.retire()
                    with contextlib.suppress(OSError):
                        remove_segment(self._dir_fd, segment_id)
                    self._health.failed_write(exc, f"syncing new segment {segment_id}")
                    raise TierDegradedError(f"cannot sync segment {segment_id}: {exc}") from exc
            self._next_id = segment_id + 1
            st = self._segments[segment_id] = self._active = _Segment(file)
            return st
        raise TierDegradedError(f"no free segment id in {self.path}: too many stray files")

    def _candidate_id(self) -> int:
        """The next id; past the last one, the lowest id no segment or stray file holds."""
        if self._next_id <= MAX_SEGMENT_ID:
            return self._next_id
        segment_id = 1
        while segment_id in self._segments or segment_id in self._taken_ids:
            segment_id += 1
        if segment_id > MAX_SEGMENT_ID:
            raise TierDegradedError(f"all {MAX_SEGMENT_ID} segment ids are in use")
        return segment_id

    def _write_record(
        self,
        future: Future[DiskExtent],
        st: _Segment,
        offset: int,
        key: bytes,
        meta: bytes,
        views: list[memoryview],
        seq: int,
    ) -> None:
        """Write one record (a writer thread) and resolve its future. The future's done
        callbacks (where an owner learns the extent) run before the segment's write count
        drops: until then compaction leaves the segment alone. Otherwise it could copy a
        record whose owner does not know it yet, hear "not wanted" from relocate, delete
        it, unlink the segment, and the owner would then adopt an extent that is gone."""
        try:
            extent = self._write_record_io(st, offset, key, meta, views, seq)
        except BaseException as exc:  # delivered on the future
            future.set_exception(exc)
        else:
            future.set_result(extent)
        finally:
            with self._lock:
                st.writing -= 1
                if st.failed and not st.writing:
                    self._give_back(st)
            st.file.unpin()

    def _write_record_io(
        self, st: _Segment, offset: int, key: bytes, meta: bytes, views: list[memoryview], seq: int
    ) -> DiskExtent:
        payload_len = sum(len(v) for v in views)
        span = record_span(len(meta), payload_len)
        try:
            header = encode_header(key, meta, payload_len, payload_checksum(views), seq=seq)
            padding = _ZERO_PAGE[: align_up(payload_len) - payload_len]
            st.file.writev([memoryview(header), *views, padding], offset)
            if self._fsync:
                st.file.sync()
        except BaseException as exc:
            # Leave a clean hole rather than a LIVE header the owner never learnt about.
            with contextlib.suppress(OSError):
                st.file.writev([_ZERO_PAGE], offset)
            with self._lock:
                st.live -= span
                st.records -= 1
                self._live -= span
                self._records -= 1
                st.failed.append((offset, span))  # given back once the segment's writes end
                if isinstance(exc, OSError):
                    self._health.failed_write(
                        exc, f"writing {span} bytes to segment {st.file.segment_id}", span
                    )
            if isinstance(exc, OSError):
                raise TierDegradedError(
                    f"write to segment {st.file.segment_id} failed: {exc}"
                ) from exc
            raise
        with self._lock:
            self._writes += 1
            self._bytes_written += span
        return DiskExtent(st.file.segment_id, offset, offset + ALIGN, payload_len)

    def _give_back(self, st: _Segment) -> None:
        """Return failed records' space: truncate trailing ones off the segment (a failed one
        followed by a written one stays, as dead bytes). With _lock held and no write in
        flight in ``st``, so no offset beyond the new end is reserved."""
        end = st.size
        st.failed.sort()
        while st.failed and sum(st.failed[-1]) == end:
            end = st.failed.pop()[0]
        st.failed.clear()  # any left lie before a written record: dead bytes for compaction
        if end == st.size:
            return
        try:
            if end == 0 and st is not self._active:
                remove_segment(self._dir_fd, st.file.segment_id)
                del self._segments[st.file.segment_id]
                st.retired = True
                st.file.retire()
            else:
                st.file.truncate(end)
        except OSError as exc:  # keep them as dead bytes: accounted, reclaimed by compaction
            self._health.failed_write(exc, f"truncating segment {st.file.segment_id}")
            return
        self._used -= st.size - end
        st.size = end

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)

    # ---- reads and deletes ----------------------------------------------------------

    def read_into(
        self, extent: DiskExtent, pieces: Sequence[Piece], *, key: bytes | None = None
    ) -> None:
        """Read the payload into ``pieces``; ``key``, if given, must match the record's key."""
        views = byte_views(pieces, writable=True)
        total = sum(len(v) for v in views)
        if total != extent.payload_len:
            raise RecordFieldError(
                f"read buffers hold {total} bytes, record payload is {extent.payload_len}"
            )
        st = self._pin(extent)
        if st is None:
            raise StaleExtentError(
                f"segment {extent.segment_id} no longer exists (compacted or deleted)"
            )
        try:
            try:
                header, checksum = self._read_record(st, extent, views)
            except OSError as exc:  # an unreadable record is refused like a corrupt one
                with self._lock:
                    self._health.failed_read(exc, f"reading segment {extent.segment_id}")
                self._refuse(st, extent, f"read failed: {exc}", logged=True)
            if key is not None and header.key != key:
                raise StaleExtentError(f"record at {extent} holds another key")
            if checksum != header.payload_checksum:
                self._refuse(st, extent, "payload checksum mismatch")
        finally:
            st.file.unpin()
        with self._lock:
            self._reads += 1
            self._bytes_read += extent.payload_len

    def delete(self, extent: DiskExtent) -> None:
        """Mark the record DEAD in place; a no-op if it already is or its segment is gone.

        If the state byte cannot be written, the failure is counted (the tier degrades) and
        the record stays LIVE: a restart may index it again (its bytes are still the key's:
        keys name their content), and compaction drops it once no owner claims it."""
        st = self._pin(extent)
        if st is None:
            return
        try:
            self._kill(st, extent)
        except OSError as exc:
            with self._lock:
                self._health.failed_write(
                    exc, f"marking a record of segment {extent.segment_id} DEAD"
                )
        finally:
            st.file.unpin()

    def _pin(self, extent: DiskExtent) -> _Segment | None:
        """Pin the extent's segment open, or return None if it no longer exists."""
        if (
            extent.offset < 0
            or extent.offset % ALIGN
            or extent.payload_offset != extent.offset + ALIGN
        ):
            raise StaleExtentError(f"{extent} is not a valid record extent")
        with self._lock:
            self._check_ready()
            st = self._segments.get(extent.segment_id)
            if st is not None:
                st.file.pin()
            return st

    def _read_record(
        self, st: _Segment, extent: DiskExtent, views: list[memoryview]
    ) -> tuple[RecordHeader, int]:
        """Read header page + payload; return the header if the record is LIVE, and the
        xxh3_64 of the payload as read (the caller compares it with the header's)."""
        head = bytearray(ALIGN)
        hasher = xxhash.xxh3_64()
        got = 0
        for i, batch in enumerate(_batches(views, HASH_BATCH)):
            # a short read means end of file: later ones read nothing, the record is refused
            got += st.file.readv(
                [memoryview(head), *batch] if i == 0 else batch, extent.offset + got
            )
            for view in batch:
                hasher.update(view)
        if got < ALIGN + extent.payload_len:
            self._refuse(
                st,
                extent,
                f"record cut short ({got} of {ALIGN + extent.payload_len} bytes)",
                torn=True,
            )
        try:
            header = decode_header(head)
        except CorruptRecordError as exc:
            self._refuse(st, extent, str(exc))
        if header.payload_len != extent.payload_len:
            raise StaleExtentError(f"{extent} does not match the record stored there")
        if not header.live:
            raise StaleExtentError(f"record at {extent} was deleted")
        return header, hasher.intdigest()

    def _refuse(
        self,
        st: _Segment,
        extent: DiskExtent,
        reason: str,
        *,
        torn: bool = False,
        logged: bool = False,
    ) -> NoReturn:
        """Count a bad record, mark it DEAD so it is never served again, and raise
        (``logged``: the health log already reported it, rate-limited)."""
        with self._lock:
            if torn:
                self._torn += 1
            else:
                self._corrupt += 1
        if not logged:
            log.warning(
                "refusing record at segment %d offset %d: %s",
                extent.segment_id,
                extent.offset,
                reason,
            )
        try:
            self._kill(st, extent)
        except (StaleExtentError, OSError) as exc:
            log.warning("could not mark the bad record DEAD: %s", exc)
        raise CorruptRecordError(f"segment {extent.segment_id} offset {extent.offset}: {reason}")

    def _kill(self, st: _Segment, extent: DiskExtent) -> bool:
        """Write the DEAD state byte and move the span to dead accounting; False if already DEAD."""
        with self._state_lock:
            page = st.file.read(ALIGN, extent.offset)
            if len(page) <= STATE_OFFSET or page[: len(MAGIC)] != MAGIC:
                raise StaleExtentError(f"no record at {extent}")
            try:
                if decode_header(page).payload_len != extent.payload_len:
                    raise StaleExtentError(f"{extent} does not match the record stored there")
            except CorruptRecordError:
                pass  # a damaged header is still killed by extent, so its space counts as dead
            if page[STATE_OFFSET] == DEAD:
                return False
            st.file.write_byte(DEAD, extent.offset + STATE_OFFSET)
            if self._fsync:
                st.file.sync()
            with self._lock:
                st.live -= extent.span
                st.records -= 1
                if not st.retired:  # a retired segment's totals were already subtracted
                    self._live -= extent.span
                    self._records -= 1
            return True

    # ---- compaction -----------------------------------------------------------------

    def compact(
        self,
        relocate: Callable[[bytes, DiskExtent, DiskExtent], bool],
        *,
        min_dead_ratio: float = 0.5,
        forget: Callable[[bytes, DiskExtent], None] | None = None,
    ) -> int:
        """Rewrite mostly-dead sealed segments; return the bytes of segment space reclaimed.

        ``relocate(key, old, new)`` is called without any tier lock held; the owner must
        answer under its own lock (False = it no longer wants the object, so the copy is
        marked DEAD). If relocate raises, the copy is deleted, that segment is kept, and
        the exception propagates. A record whose payload fails its checksum (or cannot be
        read) is not copied: ``forget(key, old)`` tells the owner it is gone for good.
        A degraded tier does not compact; a copy that fails keeps the segment (records
        already copied are marked DEAD there, so nothing is counted twice) and stops.
        """
        if not 0.0 <= min_dead_ratio <= 1.0:
            raise ConfigError(f"min_dead_ratio must be within [0, 1], got {min_dead_ratio}")
        with self._compact_lock:
            with self._lock:
                self._check_ready()
                if self._health.degraded:
                    return 0
                victims = [
                    st
                    for _, st in sorted(self._segments.items())
                    if st is not self._active
                    and st.writing == 0
                    and st.size > st.live
                    and st.size - st.live >= min_dead_ratio * st.size
                ]
                for st in victims:
                    st.file.pin()
            reclaimed = 0
            try:
                for st in victims:
                    reclaimed += self._compact_segment(st, relocate, forget)
            except TierDegradedError:
                pass  # the fault is counted and logged; the rest waits for writable space
            except OSError as exc:  # scanning a victim failed: keep it, count, stop here
                with self._lock:
                    self._health.failed_read(exc, "compaction")
            finally:
                for st in victims:
                    st.file.unpin()
            return reclaimed

    def _compact_segment(
        self,
        st: _Segment,
        relocate: Callable[[bytes, DiskExtent, DiskExtent], bool],
        forget: Callable[[bytes, DiskExtent], None] | None,
    ) -> int:
        copied = 0
        moved: list[DiskExtent] = []  # originals whose copy the owner now uses
        for rec in scan_segment(st.file).records:
            if not rec.header.live:
                continue
            old = DiskExtent(
                st.file.segment_id, rec.offset, rec.offset + ALIGN, rec.header.payload_len
            )
            # One buffered copy per record: it is read, verified, then written by the pool.
            buf = memoryview(bytearray(old.payload_len))
            try:
                try:
                    header, checksum = self._read_record(st, old, [buf])
                except OSError as exc:
                    with self._lock:
                        self._health.failed_read(exc, f"compacting segment {old.segment_id}")
                    self._refuse(st, old, f"read failed: {exc}", logged=True)
                if checksum != header.payload_checksum:
                    self._refuse(st, old, "payload checksum mismatch during compaction")
            except StaleExtentError:
                continue  # deleted meanwhile
            except CorruptRecordError:
                # counted and marked DEAD; the owner must drop it, or its extent would name
                # a segment about to vanish (a permanent stale_extent)
                if forget is not None:
                    forget(rec.header.key, old)
                continue
            try:
                new = self._append(header.key, header.meta, [buf], seq=header.seq).result()
            except TierDegradedError:
                for done in moved:  # their copies are what the owner reads now
                    self.delete(done)
                raise
            copied += new.span
            try:
                keep = relocate(header.key, old, new)
            except BaseException:
                self.delete(new)
                raise
            if keep:
                moved.append(old)
            else:
                self.delete(new)
                self.delete(old)  # so a crash before the unlink cannot resurrect it
        with self._lock:
            del self._segments[st.file.segment_id]
            st.retired = True
            self._used -= st.size
            self._live -= st.live
            self._records -= st.records
            self._compactions += 1
        remove_segment(self._dir_fd, st.file.segment_id)
        if self._fsync:
            os.fsync(self._dir_fd)
        st.file.retire()  # the fd closes once in-flight reads unpin it
        return st.size - copied

    # ---- write faults ---------------------------------------------------------------

    def probe(self) -> bool:
        """Try to leave the degraded state; return whether the tier takes records.

        At most once per ``retry_interval_s`` (earlier calls return False at once), and only
        when no write is in flight: reserve room for what failed (at least PROBE_BYTES, at
        most a segment) at the end of the active segment, creating it if needed, then
        truncate back. Success means the space (and an inode) is really there again.
        """
        with self._lock:
            if not self._health.degraded:
                return True
            if self._closed or not self._ready or not self._health.probe_due():
                return False
            if any(st.writing for st in self._segments.values()):
                return False  # failed spans are given back when these end
            need = min(max(PROBE_BYTES, 2 * self._health.need), self._segment_bytes)
            try:
                st = self._active
                if st is None or (st.size and st.size + need > self._segment_bytes):
                    st = self._new_segment()  # degraded again (counted, no id) if it fails
                try:
                    st.file.allocate(st.size, need)
                finally:
                    st.file.truncate(st.size)
            except TierDegradedError:
                return False
            except OSError as exc:  # not the failed write's size: the probe must not grow
                self._health.failed_write(exc, "probing for free space")
                return False
            self._health.recovered()
            return True

    # ---- lifecycle ------------------------------------------------------------------

    def _check_ready(self) -> None:
        """Raise unless the tier is scanned and open; called with _lock held."""
        if self._closed:
            raise KVFabricError("disk tier is closed")
        if not self._ready:
            raise KVFabricError("DiskTier.scan() must complete before the tier is used")

    def flush(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        wait(pending)
        self._pool.shutdown(wait=True)
        with self._compact_lock:  # a running compaction stops at its next append
            with self._lock:
                segments = list(self._segments.values())
                self._segments.clear()
                self._active = None
            for st in segments:
                st.file.retire()
            os.close(self._dir_fd)

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                capacity_bytes=self._capacity,
                used_bytes=self._used,
                live_bytes=self._live,
                dead_bytes=self._used - self._live,
                segments=len(self._segments),
                records_live=self._records,
                corrupt_records=self._corrupt,
                torn_records=self._torn,
                writes=self._writes,
                reads=self._reads,
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                compactions=self._compactions,
                ignored_files=self._ignored,
                degraded=self._health.degraded,
                disk_errors=dict(self._health.errors),
            )


def _batches(views: Sequence[memoryview], limit: int) -> list[list[memoryview]]:
    """``views`` cut into consecutive batches of at most ``limit`` bytes (at least one, maybe
    empty: the header page is read with the first)."""
    batches: list[list[memoryview]] = [[]]
    size = 0
    for view in views:
        start = 0
        while start < len(view):
            if size == limit:
                batches.append([])
                size = 0
            part = view[start : start + limit - size]
            batches[-1].append(part)
            size += len(part)
            start += len(part)
    return batches
