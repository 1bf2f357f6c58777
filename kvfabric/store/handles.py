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
through an expired pin. Views obtained before expiry must not be used after it. An expired
reservation's pages stay quarantined (no other object gets them) until the writer calls
:meth:`ObjectWriter.close` (leaving the ``with`` block does): a writer that was frozen
past its deadline may still write into them when it wakes up.
Handles are meant for one thread each; the store they call into is thread-safe.
"""

from __future__ import annotations

from array import array
from typing import Any, Protocol

from kvfabric.errors import LeaseExpiredError
from kvfabric.memory.copy import Piece
from kvfabric.payload import PayloadAccess, PayloadReader, PayloadWriter
from kvfabric.spec import Namespace
from kvfabric.store.index import Entry
from kvfabric.store.shards import HeadRange


class LeaseOwner(Protocol):
    """What a handle needs from the store that issued it (the store's
    :class:`~kvfabric.store.leases.Leases` implements it; each call takes the store lock)."""

    def tier_name(self, index: int) -> str: ...
    def pieces(self, entry: Entry, offset: int, length: int) -> list[Piece]: ...
    def commit_layers(self, writer: ObjectWriter, mask: int) -> bool: ...
    def abort(self, writer: ObjectWriter) -> None: ...
    def unpin(self, reader: ObjectReader) -> None: ...
    def end_quarantine(self, writer: ObjectWriter) -> None: ...
    def arena_id(self, entry: Entry) -> int | None: ...
    def layer_ready(self, entry: Entry, layer: int) -> bool: ...
    def wait_layer(self, entry: Entry, layer: int, timeout: float | None) -> None: ...


class _Lease(PayloadAccess):
    def __init__(self, owner: LeaseOwner, entry: Entry, deadline: float) -> None:
        self._owner = owner
        self._entry = entry
        self.deadline = deadline
        self.expired = False
        self.closed = False
        self.layout = entry.ns.spec.layout(entry.num_tokens)

    @property
    def key(self) -> bytes:
        return self._entry.key

    @property
    def parent(self) -> bytes:
        """Key of the chunk before this one in its chain (ROOT for a first chunk)."""
        return self._entry.parent

    @property
    def tokens(self) -> bytes | None:
        """The chunk's own token ids (int32-LE), or None when its writers gave none."""
        return self._entry.tokens

    @property
    def namespace(self) -> Namespace:
        return self._entry.ns

    @property
    def tier(self) -> str:
        return self._owner.tier_name(self._entry.tier)

    @property
    def tier_index(self) -> int:
        return self._entry.tier

    @property
    def arena_id(self) -> int | None:
        """The shared-memory arena the pages lie in (None: not a host arena)."""
        return self._owner.arena_id(self._entry)

    @property
    def pages(self) -> array[int]:
        """Page ids of the object in its (memory) tier: what a local client maps."""
        self._check_open()
        pages: array[int] = self._entry.handle
        return pages

    def _check_open(self) -> None:
        if self.expired:
            raise LeaseExpiredError(f"lease on {self.key.hex()} expired and was reclaimed")
        if self.closed:
            raise ValueError("lease already released")

    def _range_pieces(self, offset: int, length: int) -> list[Piece]:
        self._check_open()
        return self._owner.pieces(self._entry, offset, length)

    def __enter__(self) -> Any:
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key.hex()[:12]}, tier={self.tier})"


class ObjectWriter(_Lease, PayloadWriter):
    """A reservation: write layers into the object's pages, commit them, or abort.

    A head-range writer (one tensor-parallel rank, ``heads`` set) writes and commits only
    its heads; its layers become readable once every rank's heads of them are committed."""

    def __init__(
        self,
        owner: LeaseOwner,
        entry: Entry,
        deadline: float,
        *,
        heads: HeadRange | None = None,
        head_mask: int = 0,
    ) -> None:
        super().__init__(owner, entry, deadline)
        self.heads = heads
        self.head_mask = head_mask
        self.committed = 0  # layers this writer committed

    def commit_layer(self, layer: int) -> bool:
        """Publish one layer to readers; True once every layer is committed."""
        self._check_open()
        self.layout.layer_range(layer)  # validates the index
        return self._owner.commit_layers(self, 1 << layer)

    def commit_layers(self, mask: int) -> bool:
        """Publish the layers set in ``mask``; True once every layer is committed."""
        self._check_open()
        if mask <= 0 or mask >> self.layout.spec.num_layers:
            raise ValueError(f"layer mask {mask:#x} names layers outside the spec")
        return self._owner.commit_layers(self, mask)

    def commit(self) -> None:
        """Publish every layer not committed yet and end the reservation."""
        self._check_open()
        self._owner.commit_layers(self, (1 << self.layout.spec.num_layers) - 1)

    def abort(self) -> None:
        """Drop the object; readers waiting on it get an error. Idempotent."""
        if not self.closed and not self.expired:
            self._owner.abort(self)

    def close(self) -> None:
        """:meth:`abort` if still open, and give back an expired reservation's quarantined
        pages: the caller promises not to touch the pages again. Idempotent."""
        self.abort()
        if self.expired:
            self._owner.end_quarantine(self)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close()


class ObjectReader(_Lease, PayloadReader):
    """A pin: read layers (zero copy) while the object stays put."""

    def ready(self, layer: int) -> bool:
        return self._owner.layer_ready(self._entry, layer)

    @property
    def ready_mask(self) -> int:
        """Bitmask of committed layers (-1 once complete)."""
        return self._entry.ready

    @property
    def complete(self) -> bool:
        return self._entry.complete

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` is committed; DeadlineExceededError / ObjectAbortedError."""
        self._check_open()
        self.layout.layer_range(layer)
        self._owner.wait_layer(self._entry, layer, timeout)

    def wait_complete(self, timeout: float | None = None) -> None:
        for layer in range(self.layout.spec.num_layers):
            self.wait_layer(layer, timeout)

    def release(self) -> None:
        """Give the pin back. Idempotent; a no-op after expiry."""
        if not self.closed and not self.expired:
            self._owner.unpin(self)

    def __exit__(self, *exc: object) -> None:
        self.release()
