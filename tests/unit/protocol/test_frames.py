"""Frames on the control socket: length prefix, bounded msgpack bodies, incremental decoding.

The decoder is fed whatever ``recv`` returned, so every property is checked under arbitrary
splits of the byte stream; hostile input (random bytes, absurd lengths, msgpack headers that
announce billions of items, ext types, deep nesting) must only ever raise ``ProtocolError``
and must never make the decoder hold more than one bounded frame.
"""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvfabric.errors import FrameTooLargeError, ProtocolError
from kvfabric.protocol.frames import (
    HEADER,
    HELLO_FRAME,
    MAX_FRAME,
    MAX_ITEMS,
    FrameDecoder,
    decode_body,
    encode_frame,
    frame_length,
)

FAST = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------------- strategies

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=10), children, max_size=6)
    ),
    max_leaves=30,
)
messages = st.dictionaries(st.text(max_size=10), values, max_size=8)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (any order, duplicates allowed)."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return pieces


def feed_all(decoder: FrameDecoder, pieces: list[bytes]) -> list[dict]:
    out = []
    for piece in pieces:
        out.extend(decoder.feed(piece))
    return out


def frame_of_body(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


# ---------------------------------------------------------------------- valid streams


@FAST
@given(st.lists(messages, min_size=1, max_size=6), st.lists(st.integers(0, 1 << 20), max_size=12))
def test_any_split_of_a_valid_stream_decodes_to_the_same_messages(msgs, cuts) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)
    whole = feed_all(FrameDecoder(), [stream])
    pieces = split(stream, cuts)
    decoder = FrameDecoder()
    assert feed_all(decoder, pieces) == whole == msgs
    assert decoder.pending == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(messages, min_size=1, max_size=3))
def test_byte_by_byte_feeding_decodes_the_same_messages(msgs) -> None:
    frames = [encode_frame(m) for m in msgs]
    stream = b"".join(frames)
    largest = max(len(f) for f in frames)
    decoder = FrameDecoder()
    out = []
    for i in range(len(stream)):
        out.extend(decoder.feed(stream[i : i + 1]))
        assert decoder.pending < largest
    assert out == msgs
    assert decoder.pending == 0


@FAST
@given(messages, st.integers(1, 64))
def test_an_incomplete_frame_is_held_back_not_decoded(msg, missing) -> None:
    frame = encode_frame(msg)
    assume(missing <= len(frame))
    decoder = FrameDecoder()
    assert list(decoder.feed(frame[:-missing])) == []
    assert decoder.pending == len(frame) - missing
    assert list(decoder.feed(frame[-missing:])) == [msg]
    assert decoder.pending == 0


def test_frame_header_is_u32_little_endian_length() -> None:
    frame = encode_frame({"a": 1})
    body = msgpack.packb({"a": 1}, use_bin_type=True)
    assert frame == struct.pack("<I", len(body)) + body
    assert frame_length(frame[:HEADER]) == len(body)


def test_a_frame_of_exactly_the_limit_is_accepted() -> None:
    # a map whose one bin value makes the body exactly MAX_FRAME bytes
    overhead = len(msgpack.packb({"b": b"\x00" * 70000}, use_bin_type=True)) - 70000  # bin32
    msg = {"b": b"\x00" * (MAX_FRAME - overhead)}
    frame = encode_frame(msg)
    assert len(frame) == HEADER + MAX_FRAME
    decoder = FrameDecoder()
    assert feed_all(decoder, [frame[:1000], frame[1000:]]) == [msg]


def test_encoding_a_message_over_the_limit_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="limit"):
        encode_frame({"b": b"\x00" * MAX_FRAME})


# ---------------------------------------------------------------------- hostile input


@pytest.mark.parametrize("length", [MAX_FRAME + 1, 1 << 31, 0xFFFFFFFF])
def test_an_oversized_length_is_refused_from_the_header_alone(length) -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match="exceeds"):
        list(decoder.feed(struct.pack("<I", length)))
    # nothing was allocated for the announced body
    assert decoder.pending <= HEADER


def test_an_oversized_length_split_across_feeds_is_refused() -> None:
    decoder = FrameDecoder()
    header = struct.pack("<I", 0xFFFFFFFF)
    assert list(decoder.feed(header[:2])) == []
    with pytest.raises(ProtocolError):
        list(decoder.feed(header[2:] + b"junk"))


@pytest.mark.parametrize(
    "body",
    [
        b"",  # empty body
        b"\xc1",  # the one byte msgpack never uses
        b"\x81\xa1a",  # map missing its value
        b"\x92\x01",  # array missing an element
        b"\xdd\xff\xff\xff\xff",  # array32 announcing 4G items, none present
        b"\xdf\xff\xff\xff\xff",  # map32 announcing 4G entries
        b"\xdb\xff\xff\xff\xff",  # str32 announcing 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin32 announcing 4 GiB
        b"\xd6\xff\x00\x00\x00\x00",  # ext -1 (timestamp): no ext types on this wire
        b"\xc7\x01\x05\x00",  # ext8 type 5
        b"\x81\x01\x02",  # map with an int key
        b"\x81\xc0\x02",  # map with a nil key
        b"\xa2\xff\xfe",  # invalid UTF-8 in a str
        b"\x80\x80",  # two objects in one frame (extra data)
        b"\x01",  # a valid msgpack int, not a map
        b"\x90",  # an empty array, not a map
        b"\xa3abc",  # a string, not a map
        b"\x91" * 5000 + b"\x80",  # nesting deeper than any real request
    ],
)
def test_undecodable_or_non_map_bodies_raise_protocol_error(body) -> None:
    with pytest.raises(ProtocolError):
        decode_body(body)
    with pytest.raises(ProtocolError):
        list(FrameDecoder().feed(frame_of_body(body)))


def test_item_counts_over_the_limit_are_refused() -> None:
    too_many = msgpack.packb({"k": [0] * (MAX_ITEMS + 1)})
    with pytest.raises(ProtocolError):
        decode_body(too_many)
    just_right = msgpack.packb({"k": [0] * 1000})
    assert decode_body(just_right) == {"k": [0] * 1000}


@FAST
@given(st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=8))
def test_random_bytes_never_raise_anything_but_protocol_error(chunks) -> None:
    decoder = FrameDecoder()
    try:
        for chunk in chunks:
            for message in decoder.feed(chunk):
                assert isinstance(message, dict)
    except ProtocolError:
        pass
    # never holds more than one frame's worth
    assert decoder.pending <= HEADER + MAX_FRAME


@FAST
@given(st.binary(max_size=400), st.lists(st.integers(0, 1 << 16), max_size=6))
def test_random_bodies_behind_a_valid_header_raise_only_protocol_error(body, cuts) -> None:
    """The common hostile case: a plausible length, garbage msgpack behind it."""
    decoder = FrameDecoder()
    try:
        out = feed_all(decoder, split(frame_of_body(body), cuts))
    except ProtocolError:
        return
    assert len(out) == 1 and isinstance(out[0], dict)
    assert out[0] == msgpack.unpackb(body, raw=False)


@FAST
@given(messages, st.binary(min_size=1, max_size=64))
def test_garbage_after_a_good_frame_does_not_corrupt_the_good_one(msg, junk) -> None:
    decoder = FrameDecoder()
    good = list(decoder.feed(encode_frame(msg)))
    assert good == [msg]
    try:
        list(decoder.feed(junk))
    except ProtocolError:
        pass


@FAST
@given(st.integers(0, (1 << 32) - 1))
def test_frame_length_accepts_exactly_the_lengths_up_to_the_limit(length) -> None:
    header = struct.pack("<I", length)
    if length <= MAX_FRAME:
        assert frame_length(header) == length
    else:
        with pytest.raises(ProtocolError):
            frame_length(header)


def test_a_lower_limit_refuses_a_longer_frame_at_its_header() -> None:
    """Regression: on the old code every decoder took frames up to MAX_FRAME (8 MiB), so a
    peer that had not said hello could make the daemon buffer that much."""
    decoder = FrameDecoder(HELLO_FRAME)
    ok = encode_frame({"op": "hello", "pad": b"\x00" * (HELLO_FRAME - 100)})
    assert len(ok) - HEADER <= HELLO_FRAME
    assert feed_all(decoder, split(ok, [3, 1000])) == [msgpack.unpackb(ok[HEADER:])]
    with pytest.raises(FrameTooLargeError, match=f"exceeds the limit {HELLO_FRAME}"):
        list(decoder.feed(struct.pack("<I", HELLO_FRAME + 1)))  # the header alone: refused
    assert decoder.pending == HEADER  # nothing of the body was waited for, or kept


def test_the_limit_can_be_raised_between_frames() -> None:
    """The daemon raises a connection's limit once its hello is answered: frames already
    buffered behind the hello are read with the new limit.

    Regression: on the old code FrameDecoder had no limit of its own to raise."""
    big = encode_frame({"op": "lookup", "pad": b"\x00" * (HELLO_FRAME * 2)})
    decoder = FrameDecoder(HELLO_FRAME)
    frames = decoder.feed(encode_frame({"op": "hello"}) + big)
    assert next(frames) == {"op": "hello"}
    decoder.limit = MAX_FRAME
    assert next(frames)["op"] == "lookup"
    assert decoder.pending == 0
