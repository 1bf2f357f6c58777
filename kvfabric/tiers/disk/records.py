"""On-disk record format of the SSD tier (pure encode/decode/validate, no I/O).

Layout of one record, starting on an ``ALIGN`` (4096-byte) boundary of a segment::

    offset  size  field
         0     8  magic            b"KVFREC01"
         8     2  format version   u16 (currently 1)
        10     1  state            LIVE (0x4C) or DEAD (0x44); any other value is corrupt
        11     1  reserved         written as 0
        12    16  key              opaque 16-byte key
        28     4  meta length      u32, <= MAX_META
        32     8  payload length   u64, <= MAX_PAYLOAD (sanity bound)
        40     8  sequence         u64, write order; a compaction copy keeps its original
        48     8  payload checksum xxh3_64 of the payload bytes
        56     8  header checksum  xxh3_64 of bytes [0:10] + [11:56] + meta
        64     -  meta, then zero padding up to ALIGN
      ALIGN     -  payload, then zero padding up to a multiple of ALIGN

All integers are little-endian. Because ``HEADER_SIZE + MAX_META <= ALIGN`` the header,
meta and padding always fill exactly one ``ALIGN`` page, so the payload of every record
starts ``ALIGN`` bytes after the record start.

The state byte is excluded from the header checksum so that a delete is a single in-place
byte write; its value is validated instead. Every other byte of the header page (fields,
meta and padding) is covered, so any single-byte change is detected.

Errors: malformed stored bytes raise :class:`CorruptRecordError`; arguments that cannot be
encoded (bad key, oversized meta or payload) raise :class:`RecordFieldError`. Everything
here is pure and thread-safe.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from kvfabric.errors import CorruptRecordError, KVFabricError

MAGIC = b"KVFREC01"
VERSION = 1
ALIGN = 4096
KEY_LEN = 16
MAX_META = 3072
MAX_PAYLOAD = 1 << 30  # sanity bound: a header claiming more is corrupt, never allocated
LIVE = 0x4C  # b"L"; LIVE ^ 0xFF and other single-bit flips are invalid, not DEAD
DEAD = 0x44  # b"D"

_HEADER = struct.Struct("<8sHBB16sIQQQQ")
HEADER_SIZE = _HEADER.size
STATE_OFFSET = 10
_CHECKSUM_OFFSET = 56
_ZERO_PAGE = bytes(ALIGN)

assert HEADER_SIZE == 64 and HEADER_SIZE + MAX_META <= ALIGN


class RecordFieldError(KVFabricError, ValueError):
    """A key, meta blob, payload length or buffer cannot be used to form or read a record."""

    kind = "bad_record"


@dataclass(frozen=True)
class RecordHeader:
    """The decoded, verified header page of one record."""

    version: int
    state: int
    key: bytes
    meta: bytes
    payload_len: int
    seq: int
    payload_checksum: int

    @property
    def live(self) -> bool:
        return self.state == LIVE

    @property
    def span(self) -> int:
        """Bytes the whole record occupies in its segment."""
        return record_span(len(self.meta), self.payload_len)


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def validate_fields(
    key: bytes, meta: bytes, payload_len: int, *, max_payload: int = MAX_PAYLOAD
) -> None:
    """Raise RecordFieldError unless (key, meta, payload_len) can be encoded."""
    if not isinstance(key, bytes) or len(key) != KEY_LEN:
        raise RecordFieldError(f"key must be {KEY_LEN} bytes, got {type(key).__name__} {key!r:.60}")
    if not isinstance(meta, bytes) or len(meta) > MAX_META:
        size = len(meta) if isinstance(meta, bytes) else type(meta).__name__
        raise RecordFieldError(f"meta must be bytes of at most {MAX_META} bytes, got {size}")
    if not 0 <= payload_len <= max_payload:
        raise RecordFieldError(f"payload length {payload_len} outside [0, {max_payload}]")


def record_span(meta_len: int, payload_len: int) -> int:
    """Bytes a record with these lengths occupies in a segment (a multiple of ALIGN)."""
    if not 0 <= meta_len <= MAX_META or payload_len < 0:
        raise RecordFieldError(f"invalid record lengths meta={meta_len} payload={payload_len}")
    return align_up(HEADER_SIZE + meta_len) + align_up(payload_len)


def payload_checksum(pieces: Iterable[bytes | bytearray | memoryview]) -> int:
    """xxh3_64 of the concatenation of ``pieces`` (no copy is made)."""
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


def _header_checksum(fields: memoryview, meta: memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(fields[:STATE_OFFSET])
    h.update(fields[STATE_OFFSET + 1 : _CHECKSUM_OFFSET])
    h.update(meta)
    return h.intdigest()


def encode_header(
    key: bytes,
    meta: bytes,
    payload_len: int,
    checksum: int,
    *,
    seq: int,
    state: int = LIVE,
    max_payload: int = MAX_PAYLOAD,
) -> bytes:
    """Return the ALIGN-byte header page (header + meta + zero padding) of a record."""
    validate_fields(key, meta, payload_len, max_payload=max_payload)
    if state not in (LIVE, DEAD):
        raise RecordFieldError(f"invalid state {state:#x}")
    page = bytearray(ALIGN)
    _HEADER.pack_into(
        page, 0, MAGIC, VERSION, state, 0, key, len(meta), payload_len, seq, checksum, 0
    )
    page[HEADER_SIZE : HEADER_SIZE + len(meta)] = meta
    view = memoryview(page)
    digest = _header_checksum(view, view[HEADER_SIZE : HEADER_SIZE + len(meta)])
    struct.pack_into("<Q", page, _CHECKSUM_OFFSET, digest)
    return bytes(page)


def decode_header(
    buf: bytes | bytearray | memoryview, *, max_payload: int = MAX_PAYLOAD
) -> RecordHeader:
    """Decode and verify a header page; raise CorruptRecordError on any inconsistency.

    ``buf`` must hold at least the header and meta; if it extends over the padding (up to
    ALIGN bytes) the padding must be zero. Lengths are bounded before anything is sliced.
    """
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_SIZE:
        raise CorruptRecordError(f"record header truncated: {len(view)} < {HEADER_SIZE} bytes")
    magic, version, state, _reserved, key, meta_len, payload_len, seq, p_sum, h_sum = (
        _HEADER.unpack_from(view)
    )
    if magic != MAGIC:
        raise CorruptRecordError(f"bad record magic {magic!r}")
    if version != VERSION:
        raise CorruptRecordError(f"unsupported record format version {version}")
    if state not in (LIVE, DEAD):
        raise CorruptRecordError(f"invalid record state byte {state:#04x}")
    if meta_len > MAX_META:
        raise CorruptRecordError(f"record meta length {meta_len} exceeds {MAX_META}")
    if payload_len > max_payload:
        raise CorruptRecordError(
            f"record payload length {payload_len} exceeds sanity bound {max_payload}"
        )
    meta_end = HEADER_SIZE + meta_len
    if len(view) < meta_end:
        raise CorruptRecordError(f"record meta truncated: {len(view)} < {meta_end} bytes")
    if _header_checksum(view, view[HEADER_SIZE:meta_end]) != h_sum:
        raise CorruptRecordError("record header checksum mismatch")
    padding = view[meta_end:ALIGN]
    # compared as bytes: a memoryview comparison goes item by item (~30x slower)
    if padding.tobytes() != _ZERO_PAGE[: len(padding)]:
        raise CorruptRecordError("record header padding is not zero")
    return RecordHeader(
        version, state, key, bytes(view[HEADER_SIZE:meta_end]), payload_len, seq, p_sum
    )
