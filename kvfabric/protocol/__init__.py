"""The control protocol between clients and the node daemon (frames, messages, limits)."""

from kvfabric.protocol.frames import MAX_FRAME, FrameDecoder, encode_frame
from kvfabric.protocol.messages import PROTOCOL_VERSION, Op

__all__ = ["MAX_FRAME", "PROTOCOL_VERSION", "FrameDecoder", "Op", "encode_frame"]
