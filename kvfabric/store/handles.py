"""Leases on stored objects: the writer's reservation and a reader's pin.

Both are context managers that always give the lease back.

* :class:`ObjectWriter` — returned by :meth:`TieredStore.reserve`. The object's pages are
  allocated up front; the producer writes each layer straight into them
  (:meth:`~ObjectWriter.layer_pieces` are views, zero copy) and commits layers one by one, so
  readers can start on layer 0 while later layers are still being computed. Leaving the
  ``with`` block without committing every layer aborts the object.
* :class:`ObjectReader` — returned by :meth:`TieredStore.get`. While it is held the object
  cannot move or be evicted. :meth:`~ObjectReader.wait_layer` blocks until a layer is
  committed; reading a layer that is not committed yet is an error, not a torn read.

Leases have deadlines (set by the store's config). After a deadline the store reclaims the
lease: a late commit raises :class:`~kvfabric.errors.LeaseExpiredError`, and so does a read
through an expired pin. Views obtained before expiry must not be used after it.
Handles are meant for one thread each; the store they call into is thread-safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.errors import LeaseExpiredError, PayloadSizeError, SpecError
from kvfabric.memory.copy import Piece, as_bytes_view, copy_pieces, nbytes_of, total_bytes
from kvfabric.spec import ChunkLayout, Namespace

if TYPE_CHECKING:
    from kvfabric.store.index import Entry
    from kvfabric.store.store import TieredStore


class _Lease:
    def __init__(self, store: "TieredStore", entry: "Entry", deadline: float) -> None:
        self._store = store
        self._entry = entry
        self.deadline = deadline
        self.expired = False
        self.closed = False
        self.layout: ChunkLayout = entry.ns.spec.layout(entry.num_tokens)

    @property
    def key(self) -> bytes:
        return self._entry.key

    @property
    def namespace(self) -> Namespace:
        return self._entry.ns

    @property
    def num_tokens(self) -> int:
        return self._entry.num_tokens

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def tier(self) -> str:
        return self._store.tier_name(self._entry.tier)

    def _check_open(self) -> None:
        if self.expired:
            raise LeaseExpiredError(f"lease on {self.key.hex()} expired and was reclaimed")
        if self.closed:
            raise ValueError("lease already released")

    def _pieces(self, layer: int | None, heads: tuple[int, int] | None) -> list[Piece]:
        self._check_open()
        if layer is None:
            if heads is not None:
                raise SpecError("a head range needs a layer")
            return self._store._pieces(self._entry, 0, self.layout.nbytes)
        if heads is None:
            return self._store._pieces(self._entry, *self.layout.layer_range(layer))
        out: list[Piece] = []
        for offset, length in self.layout.head_ranges(layer, *heads):
            out.extend(self._store._pieces(self._entry, offset, length))
        return out

    def __enter__(self) -> Any:
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key.hex()[:12]}, tier={self.tier})"


class ObjectWriter(_Lease):
    """A reservation: write layers into the object's pages, commit them, or abort."""

    def layer_pieces(self, layer: int, heads: tuple[int, int] | None = None) -> list[Piece]:
        """Views of one layer (or of one head range per K/V plane) to write into."""
        return self._pieces(layer, heads)

    def write_layer(self, layer: int, data: Any, heads: tuple[int, int] | None = None) -> None:
        """Copy ``data`` (bytes-like, numpy array or tensor) into a layer or head range."""
        _copy_exact(self.layer_pieces(layer, heads), data, f"layer {layer}")

    def write(self, data: Any) -> None:
        """Copy a whole payload in canonical layout (all layers)."""
        _copy_exact(self._pieces(None, None), data, "payload")

    def commit_layer(self, layer: int) -> None:
        """Publish one layer to readers (they may already be waiting on it)."""
        self._check_open()
        self.layout.layer_range(layer)  # validates the index
        self._store._commit_layers(self, 1 << layer)

    def commit(self) -> None:
        """Publish every layer not committed yet and end the reservation."""
        self._check_open()
        self._store._commit_layers(self, (1 << self.layout.spec.num_layers) - 1)

    def abort(self) -> None:
        """Drop the object; readers waiting on it get an error. Idempotent."""
        if not self.closed and not self.expired:
            self._store._abort(self)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if not self.closed and not self.expired:
            self._store._abort(self)


class ObjectReader(_Lease):
    """A pin: read layers (zero copy) while the object stays put."""

    def ready(self, layer: int) -> bool:
        return self._store._layer_ready(self._entry, layer)

    @property
    def complete(self) -> bool:
        return self._entry.complete

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` is committed; DeadlineExceededError / ObjectAbortedError."""
        self._check_open()
        self.layout.layer_range(layer)
        self._store._wait_layer(self._entry, layer, timeout)

    def wait_complete(self, timeout: float | None = None) -> None:
        for layer in range(self.layout.spec.num_layers):
            self.wait_layer(layer, timeout)

    def layer_pieces(self, layer: int, heads: tuple[int, int] | None = None) -> list[Piece]:
        """Zero-copy views of a committed layer, or of one head range per K/V plane."""
        if not self.ready(layer):
            raise ValueError(f"layer {layer} of {self.key.hex()} is not committed yet; "
                             f"call wait_layer first")
        return self._pieces(layer, heads)

    def pieces(self) -> list[Piece]:
        """Zero-copy views of the whole payload (the object must be complete)."""
        if not self._entry.complete:
            raise ValueError(f"{self.key.hex()} is still being written; wait_complete first")
        return self._pieces(None, None)

    def read_into(self, out: Any, layer: int | None = None,
                  heads: tuple[int, int] | None = None) -> None:
        """Copy the payload, a layer, or a head range into a caller buffer of the exact size."""
        src = self.pieces() if layer is None else self.layer_pieces(layer, heads)
        dst = as_bytes_view(out)
        if nbytes_of(dst) != total_bytes(src):
            raise PayloadSizeError(f"destination holds {nbytes_of(dst)} bytes, the "
                                   f"{'payload' if layer is None else 'range'} is "
                                   f"{total_bytes(src)}")
        copy_pieces([dst], src)

    def to_bytes(self) -> bytes:
        out = np.empty(self.layout.nbytes, dtype=np.uint8)
        self.read_into(out)
        return out.tobytes()

    def release(self) -> None:
        """Give the pin back. Idempotent; a no-op after expiry."""
        if not self.closed and not self.expired:
            self._store._unpin(self)

    def __exit__(self, *exc: object) -> None:
        self.release()


def _copy_exact(dst: list[Piece], data: Any, what: str) -> None:
    src = as_bytes_view(data)
    expected = total_bytes(dst)
    if nbytes_of(src) != expected:
        raise PayloadSizeError(f"{what} must be {expected} bytes, got {nbytes_of(src)}")
    copy_pieces(dst, [src])
