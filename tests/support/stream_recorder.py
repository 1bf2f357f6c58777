"""A stand-in for the compiled copy kernel that records what each ``copy_pieces`` call asked
for (its ``stream_min``: from how many bytes the copy stores non-temporally) and still copies
through the real kernel. Non-temporal stores cannot be seen from Python; the threshold a
caller passes can."""

from __future__ import annotations

from typing import Any


class StreamRecorder:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.stream_min: list[int] = []

    def copy_pieces(self, dst: Any, src: Any, stream_min: int) -> int:
        self.stream_min.append(stream_min)
        return int(self.kernel.copy_pieces(dst, src, stream_min))

    def __getattr__(self, name: str) -> Any:  # the kernel's other routines, unchanged
        return getattr(self.kernel, name)
