"""Layer and head-range access to one chunk payload held as page pieces.

The store's handles (in-process) and the client's handles (pages of a shared arena mapped
from the daemon) expose the same data-plane API; both derive from :class:`PayloadWriter` /
:class:`PayloadReader` and only say how to get the pieces of a byte range and whether a
layer is committed. Everything here is a memory operation: no locks, no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from kvfabric.errors import AlreadyExistsError, PayloadSizeError, SpecError
from kvfabric.memory.copy import Piece, as_bytes_view, copy_pieces, nbytes_of, total_bytes
from kvfabric.spec import ChunkLayout

HeadRange = tuple[int, int]


class PayloadAccess(ABC):
    """Byte geometry of a chunk (``layout``) plus a way to view any range of it."""

    layout: ChunkLayout

    @abstractmethod
    def _range_pieces(self, offset: int, length: int) -> list[Piece]:
        """Views of bytes ``[offset, offset + length)`` of the payload (zero copy)."""

    def _pieces(self, layer: int | None, heads: HeadRange | None) -> list[Piece]:
        if layer is None:
            if heads is not None:
                raise SpecError("a head range needs a layer")
            return self._range_pieces(0, self.layout.nbytes)
        if heads is None:
            return self._range_pieces(*self.layout.layer_range(layer))
        out: list[Piece] = []
        for offset, length in self.layout.head_ranges(layer, *heads):
            out.extend(self._range_pieces(offset, length))
        return out

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens


class PayloadWriter(PayloadAccess):
    """Write side: views to fill, or copies from caller buffers of the exact size.

    A writer with ``heads`` set (one tensor-parallel rank's KV-head range) reaches only those
    heads: a layer means its heads of the layer."""

    heads: HeadRange | None = None

    def layer_pieces(self, layer: int, heads: HeadRange | None = None) -> list[Piece]:
        """Views of one layer (or of one head range per K/V plane) to write into."""
        return self._pieces(layer, self._own(heads))

    def write_layer(self, layer: int, data: Any, heads: HeadRange | None = None) -> None:
        """Copy ``data`` (bytes-like, numpy array or tensor) into a layer or head range."""
        _copy_exact(self._pieces(layer, self._own(heads)), data, f"layer {layer}")

    def write(self, data: Any) -> None:
        """Copy a whole payload in canonical layout (all layers)."""
        if self.heads is not None:
            raise ValueError("a head-range writer writes layer by layer (write_layer)")
        _copy_exact(self._pieces(None, None), data, "payload")

    def _own(self, heads: HeadRange | None) -> HeadRange | None:
        if self.heads is None:
            return heads
        if heads is None:
            return self.heads
        if not self.heads[0] <= heads[0] < heads[1] <= self.heads[1]:
            raise ValueError(f"heads {heads} are outside this writer's range {self.heads}")
        return heads


class PayloadReader(PayloadAccess):
    """Read side: zero-copy views of committed layers, or copies into caller buffers."""

    @abstractmethod
    def ready(self, layer: int) -> bool:
        """Whether ``layer`` is committed (readable)."""

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Whether every layer is committed."""

    def layer_pieces(self, layer: int, heads: HeadRange | None = None) -> list[Piece]:
        """Zero-copy views of a committed layer, or of one head range per K/V plane."""
        if not self.ready(layer):
            raise ValueError(f"layer {layer} is not committed yet; call wait_layer first")
        return self._pieces(layer, heads)

    def pieces(self) -> list[Piece]:
        """Zero-copy views of the whole payload (the object must be complete)."""
        if not self.complete:
            raise ValueError("the object is still being written; wait for every layer first")
        return self._pieces(None, None)

    def read_into(self, out: Any, layer: int | None = None, heads: HeadRange | None = None) -> None:
        """Copy the payload, a layer, or a head range into a caller buffer of the exact size."""
        src = self.pieces() if layer is None else self.layer_pieces(layer, heads)
        dst = as_bytes_view(out)
        expected = self.layout.nbytes if layer is None else total_bytes(src)
        if nbytes_of(dst) != expected:
            raise PayloadSizeError(
                f"destination holds {nbytes_of(dst)} bytes, the "
                f"{'payload' if layer is None else 'range'} is {expected}"
            )
        copy_pieces([dst], src, read_soon=True)  # a load: the engine reads it next

    def to_bytes(self) -> bytes:
        out = np.empty(self.layout.nbytes, dtype=np.uint8)
        self.read_into(out)
        return out.tobytes()


class WholeWriter(AbstractContextManager[Any], Protocol):
    """A writer that takes a whole payload: the store's and the client's handles."""

    def write(self, data: Any) -> None: ...
    def commit(self) -> None: ...


def put_whole(reserve: Callable[[], WholeWriter], data: Any) -> bool:
    """``put`` of the store and of the client: reserve, copy the whole payload, commit
    (the writer aborts if the copy fails); ``False`` when the key is already stored."""
    try:
        writer = reserve()
    except AlreadyExistsError:
        return False
    with writer:
        writer.write(data)
        writer.commit()
    return True


def _copy_exact(dst: list[Piece], data: Any, what: str) -> None:
    src = as_bytes_view(data)
    expected = total_bytes(dst)
    if nbytes_of(src) != expected:
        raise PayloadSizeError(f"{what} must be {expected} bytes, got {nbytes_of(src)}")
    copy_pieces(dst, [src])
