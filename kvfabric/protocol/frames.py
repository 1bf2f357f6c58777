"""Length-prefixed msgpack frames.

Wire format: ``u32le body_length`` then ``body_length`` bytes of msgpack. The length is
checked against :data:`MAX_FRAME` *before* any buffer for the body is allocated, and the
msgpack decoder runs with per-type size limits, so a hostile peer cannot make either side
allocate more than one bounded frame. Only plain msgpack types cross the wire: no ext types,
no pickle.

A decoder's ``limit`` may be lower than :data:`MAX_FRAME`: the daemon reads a connection's
first frame (its ``hello``) with :data:`HELLO_FRAME` so that an unauthenticated peer can make
it hold at most that much; the length in the header is checked as soon as the header is
complete, so a body over the limit is refused before any of it is kept.

:class:`FrameDecoder` is incremental (feed it whatever ``recv`` returned) and is shared by the
blocking client, the asyncio client and the server. Not thread-safe: one per connection.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack

from kvfabric.errors import FrameTooLargeError, ProtocolError

MAX_FRAME = 8 << 20  # lookups by token ids of 1M+ tokens fit; payload bytes never travel here
MAX_ITEMS = 1 << 20  # array / map entries per frame
HELLO_FRAME = 64 << 10  # default limit before hello: a token and a client name fit many times
_LEN = struct.Struct("<I")
HEADER = _LEN.size


def encode_frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the frame limit {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes | memoryview) -> dict[str, Any]:
    """One frame body -> a message map (``ProtocolError`` for anything else)."""
    try:
        message = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_FRAME,
            max_str_len=MAX_FRAME,
            max_array_len=MAX_ITEMS,
            max_map_len=MAX_ITEMS,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a frame must hold a map, got {type(message).__name__}")
    return message


def frame_length(header: bytes, limit: int = MAX_FRAME) -> int:
    length = int(_LEN.unpack(header)[0])
    if length > limit:
        raise FrameTooLargeError(f"frame of {length} bytes exceeds the limit {limit}")
    return length


class FrameDecoder:
    """Turns a byte stream into messages; raises ``ProtocolError`` on a bad frame
    (:class:`~kvfabric.errors.FrameTooLargeError` for a length over ``limit``, which is read
    at each frame: the daemon raises it once a connection's hello is answered)."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self._buffer = bytearray()
        self.limit = limit

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        self._buffer += data
        while len(self._buffer) >= HEADER:
            length = frame_length(bytes(self._buffer[:HEADER]), self.limit)
            if len(self._buffer) < HEADER + length:
                return
            end = HEADER + length
            body = memoryview(self._buffer)[HEADER:end]  # no copy: msgpack copies what it keeps
            try:
                message = decode_body(body)
            finally:
                body.release()  # before the buffer is resized
                del self._buffer[:end]
            yield message

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back (never more than one frame's worth)."""
        return len(self._buffer)
