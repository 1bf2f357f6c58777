"""Handles on objects held by the daemon, read and written in shared memory.

:class:`RemoteWriter` / :class:`RemoteReader` have the same data-plane API as the store's
in-process handles (:mod:`kvfabric.payload`): ``layer_pieces`` are numpy views straight
into the daemon's arena pages, so a put or a get moves no payload byte through the socket.
Only the lease operations (commit, abort, wait, release) are requests. Every handle is a
context manager that gives its lease back (a writer that did not commit every layer aborts).

A handle belongs to the session that created it: after a reconnect (daemon restart) its
lease is gone and lease operations raise :class:`~kvfabric.errors.UnavailableError`.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from typing import Any

from kvfabric.client.arenas import PageViewer
from kvfabric.errors import LeaseExpiredError, UnavailableError
from kvfabric.payload import HeadRange, PayloadAccess, PayloadReader, PayloadWriter
from kvfabric.protocol.messages import Op
from kvfabric.readspec import ReadSpec
from kvfabric.spec import Namespace

READY_ALL = -1
LEASE_SAFETY = 0.9  # share of the lease a client uses: margin for clock steps and transit
REPLY_MARGIN_S = 5.0  # a wait's reply may take its whole timeout plus the trip back


class _RemoteLease(PayloadAccess):
    WRITES = False  # writers view their pages through the arena's writable mapping

    def __init__(self, session: Any, ns: Namespace, key: bytes, reply: dict[str, Any]) -> None:
        self._session = session  # the connection this lease lives on
        self.namespace = ns
        self.key = key
        self.lease = int(reply["lease"])
        self.tier_index = int(reply["tier"])
        self.layout = ns.spec.layout(int(reply["num_tokens"]))
        pages = array("I")
        pages.frombytes(reply["pages"])
        # the arena the pages lie in (a daemon that does not say has one per tier)
        self.arena_id = int(reply.get("arena", self.tier_index))
        self._viewer: PageViewer = session.arenas.viewer(self.arena_id, pages, write=self.WRITES)
        # stop short of the daemon's deadline: after it the pages may hold another object
        self.deadline = time.monotonic() + float(reply.get("lease_s", 0.0)) * LEASE_SAFETY
        self.closed = False

    def renewed(self, reply: dict[str, Any]) -> None:
        """A partial commit's reply: the daemon renewed the lease (``lease_s`` left)."""
        if "lease_s" in reply:
            self.deadline = time.monotonic() + float(reply["lease_s"]) * LEASE_SAFETY

    def _range_pieces(self, offset: int, length: int) -> list[Any]:
        if self.closed:
            raise ValueError("lease already given back")
        if time.monotonic() >= self.deadline:
            raise LeaseExpiredError(
                f"the lease on {self.key.hex()} has run out; its pages "
                f"may belong to another object now"
            )
        return self._viewer.pieces(offset, length)

    def _call(self) -> Callable[..., Any]:
        if self._session.closed:
            raise UnavailableError("the session holding this lease is gone (daemon restart?)")
        call: Callable[..., Any] = self._session.call
        return call

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key.hex()[:12]}, lease={self.lease})"


class RemoteWriter(_RemoteLease, PayloadWriter):
    WRITES = True

    def __init__(
        self,
        session: Any,
        ns: Namespace,
        key: bytes,
        reply: dict[str, Any],
        *,
        heads: HeadRange | None = None,
    ) -> None:
        super().__init__(session, ns, key, reply)
        self.heads = heads

    def _commit_args(self, layer: int | None) -> dict[str, Any]:
        if layer is None:
            return {"lease": self.lease}
        self.layout.layer_range(layer)  # validate before asking
        return {"lease": self.lease, "layers": 1 << layer}

    def commit_layer(self, layer: int) -> bool:
        """Publish one layer; True once every layer is committed (the lease then ends,
        else it is renewed)."""
        reply = self._call()(Op.COMMIT, self._commit_args(layer))
        self.renewed(reply)
        self.closed = bool(reply["done"])
        return self.closed

    def commit(self) -> None:
        self._call()(Op.COMMIT, self._commit_args(None))
        self.closed = True

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if not self._session.closed:
                self._session.call(Op.ABORT, {"lease": self.lease})

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class RemoteReader(_RemoteLease, PayloadReader):
    def __init__(
        self,
        session: Any,
        ns: Namespace,
        key: bytes,
        reply: dict[str, Any],
        *,
        want: ReadSpec | None = None,
    ) -> None:
        super().__init__(session, ns, key, reply)
        self.ready_mask = int(reply["ready"])
        # how the consumer asked to read it (kvfabric.convert.request reads it that way)
        self.want = want

    def ready(self, layer: int) -> bool:
        return self.ready_mask == READY_ALL or bool(self.ready_mask >> layer & 1)

    @property
    def complete(self) -> bool:
        return self.ready_mask == READY_ALL

    def _wait_args(self, layer: int, timeout: float) -> dict[str, Any]:
        self.layout.layer_range(layer)
        return {"lease": self.lease, "layer": layer, "timeout": timeout}

    def wait_layer(self, layer: int, timeout: float = 30.0) -> None:
        """Block until ``layer`` is committed (the writer may be on another process)."""
        if not self.ready(layer):
            reply = self._call()(
                Op.WAIT_LAYER, self._wait_args(layer, timeout), timeout + REPLY_MARGIN_S
            )
            self.ready_mask = int(reply["ready"])

    def wait_complete(self, timeout: float = 30.0) -> None:
        for layer in range(self.layout.spec.num_layers):
            self.wait_layer(layer, timeout)

    def release(self) -> None:
        """Give the pin back; raises LeaseExpiredError if it had expired (data may be torn)."""
        if not self.closed:
            self.closed = True
            if not self._session.closed:
                self._session.call(Op.RELEASE, {"lease": self.lease})

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
