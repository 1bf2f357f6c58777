"""Unit tests for the SSD tier's on-disk record format."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.errors import CorruptRecordError
from kvfabric.tiers.disk import records as rec

KEY = bytes(range(16))


def _page(meta: bytes = b"meta-blob", payload_len: int = 12345, seq: int = 7) -> bytes:
    return rec.encode_header(KEY, meta, payload_len, 0xDEADBEEF12345678, seq=seq)


def test_round_trip_and_layout() -> None:
    page = _page()
    assert len(page) == rec.ALIGN
    assert page[:8] == rec.MAGIC and page[rec.STATE_OFFSET] == rec.LIVE
    header = rec.decode_header(page)
    assert header == rec.RecordHeader(
        rec.VERSION, rec.LIVE, KEY, b"meta-blob", 12345, 7, 0xDEADBEEF12345678
    )
    assert header.live
    assert header.span == rec.ALIGN + 16384 == rec.record_span(9, 12345)
    # Header + meta alone (no padding) is enough to decode.
    assert rec.decode_header(page[: rec.HEADER_SIZE + 9]) == header


@settings(max_examples=60, deadline=None, database=None)
@given(
    key=st.binary(min_size=16, max_size=16),
    meta=st.binary(max_size=rec.MAX_META),
    payload_len=st.integers(0, rec.MAX_PAYLOAD),
    seq=st.integers(0, 2**64 - 1),
    checksum=st.integers(0, 2**64 - 1),
    dead=st.booleans(),
)
def test_round_trip_property(
    key: bytes, meta: bytes, payload_len: int, seq: int, checksum: int, dead: bool
) -> None:
    state = rec.DEAD if dead else rec.LIVE
    header = rec.decode_header(
        rec.encode_header(key, meta, payload_len, checksum, seq=seq, state=state)
    )
    assert (header.key, header.meta, header.payload_len, header.seq, header.payload_checksum) == (
        key,
        meta,
        payload_len,
        seq,
        checksum,
    )
    assert header.live is not dead
    assert header.span % rec.ALIGN == 0 and header.span >= rec.ALIGN + payload_len


def test_state_change_is_a_single_byte_outside_the_checksum() -> None:
    page = bytearray(_page())
    page[rec.STATE_OFFSET] = rec.DEAD
    assert rec.decode_header(page).state == rec.DEAD


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_single_byte_flip_in_header_page_is_detected(mask: int) -> None:
    page = _page(meta=b"m" * 200)
    for pos in range(rec.ALIGN):
        flipped = bytearray(page)
        flipped[pos] ^= mask
        if pos == rec.STATE_OFFSET:
            try:
                header = rec.decode_header(flipped)
            except CorruptRecordError as exc:
                assert "state" in str(exc)
            else:  # the only valid outcome of a state flip is the other valid state
                assert header.state == rec.DEAD and rec.LIVE ^ mask == rec.DEAD
            continue
        with pytest.raises(CorruptRecordError):
            rec.decode_header(flipped)


def test_live_and_dead_are_not_one_common_flip_apart() -> None:
    for mask in (0x01, 0x02, 0x80, 0xFF):
        assert rec.LIVE ^ mask != rec.DEAD


def _with_fields(**changes: object) -> bytearray:
    """A header page with raw fields rewritten and the header checksum recomputed."""
    page = bytearray(_page(meta=b""))
    names = [
        "magic",
        "version",
        "state",
        "reserved",
        "key",
        "meta_len",
        "payload_len",
        "seq",
        "psum",
        "hsum",
    ]
    values = dict(zip(names, struct.unpack_from("<8sHBB16sIQQQQ", page), strict=True))
    values.update(changes)
    struct.pack_into("<8sHBB16sIQQQQ", page, 0, *(values[n] for n in names))
    h = xxhash.xxh3_64()
    h.update(bytes(page[:10]) + bytes(page[11:56]))
    struct.pack_into("<Q", page, 56, h.intdigest())
    return page


def test_bad_magic_version_and_state_have_clear_messages() -> None:
    with pytest.raises(CorruptRecordError, match="magic"):
        rec.decode_header(_with_fields(magic=b"KVFREC99"))
    with pytest.raises(CorruptRecordError, match="version 2"):
        rec.decode_header(_with_fields(version=2))
    with pytest.raises(CorruptRecordError, match="state"):
        rec.decode_header(_with_fields(state=0))
    with pytest.raises(CorruptRecordError, match="meta length"):
        rec.decode_header(_with_fields(meta_len=rec.MAX_META + 1))
    assert rec.decode_header(_with_fields()).payload_len == 12345  # the helper itself is sound


def test_huge_payload_length_refused_before_allocation() -> None:
    huge = rec.encode_header(KEY, b"", 1 << 40, 0, seq=1, max_payload=1 << 62)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecordError, match="sanity bound"):
            rec.decode_header(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(rec.RecordFieldError):
        rec.encode_header(KEY, b"", rec.MAX_PAYLOAD + 1, 0, seq=1)


def test_truncated_buffers_are_corrupt() -> None:
    page = _page(meta=b"x" * 100)
    with pytest.raises(CorruptRecordError, match="header truncated"):
        rec.decode_header(page[:40])
    with pytest.raises(CorruptRecordError, match="meta truncated"):
        rec.decode_header(page[: rec.HEADER_SIZE + 50])


def test_invalid_fields_are_refused_at_encode() -> None:
    for key, meta in [(b"short", b""), (KEY, b"m" * (rec.MAX_META + 1)), ("x" * 16, b"")]:
        with pytest.raises(rec.RecordFieldError):
            rec.encode_header(key, meta, 0, 0, seq=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # RecordFieldError is a ValueError
        rec.record_span(rec.MAX_META + 1, 0)
    assert rec.record_span(rec.MAX_META, 0) == rec.ALIGN
    assert rec.record_span(0, 1) == 2 * rec.ALIGN


def test_payload_checksum_is_over_the_concatenation() -> None:
    data = bytes(range(256)) * 40
    pieces = [memoryview(data)[:4096], memoryview(data)[4096:5096], memoryview(data)[5096:]]
    assert rec.payload_checksum(pieces) == xxhash.xxh3_64_intdigest(data)
    assert rec.payload_checksum([]) == xxhash.xxh3_64_intdigest(b"")
