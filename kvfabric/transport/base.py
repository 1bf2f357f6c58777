"""Peer transport interface: one-sided reads and writes of registered memory between nodes.

Contract (every backend):

* ``register(region_id, buffer)`` exposes a writable, C-contiguous buffer (an arena's
  ``array``, a numpy array, an mmap) under a small integer id; ``unregister(region_id)`` hides
  it again. The caller keeps the memory alive and unregisters only regions with no transfer in
  flight (the store's page leases guarantee that).
* ``descriptor() -> bytes`` is what a peer needs to reach us: msgpack, versioned, holding our
  name, backend, regions and endpoint, and an HMAC when a cluster secret is set. Export it
  *after* registering; peers see later regions only after re-``connect``-ing with a new one.
* ``connect(peer_descriptor, deadline) -> Peer`` verifies the descriptor (``AuthError`` for a
  wrong or missing secret) and makes the peer reachable. Connecting again refreshes it.
* ``read(peer, [ReadPiece(remote_region, remote_offset, local_view), ...], deadline)`` pulls
  every piece in one transfer; ``write(peer, [WritePiece(local_view, remote_region,
  remote_offset), ...], deadline)`` pushes. Local views must lie inside a region registered
  on *this* transport (one-sided backends can only move registered memory; the socket
  backend enforces the same rule so code behaves the same on both). Remote pieces must lie
  inside a region the peer registered: ``ProtocolError`` otherwise, and nothing moves.
* ``notify(peer, message, deadline)`` sends a small message; ``poll_notifications()`` returns
  ``[(peer_name, message), ...]`` received since the last poll, never blocking.
* ``close()`` releases everything; later calls raise ``UnavailableError``.

Deadlines are *seconds from the call*. Every blocking call raises ``DeadlineExceededError``
once its deadline passes (no transport times out on a frozen peer by itself, so this layer
does) and ``UnavailableError`` when the peer is gone. After either error no byte of the
failed transfer lands in local memory any more: the connection or transfer handle is torn
down before the error is raised. A failed read may have filled local views partially.

Thread-safety: a transport may be used from many threads at once; ``register`` /
``unregister`` / ``close`` are serialised internally, transfers to one peer may overlap.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import msgpack
import numpy as np

from kvfabric.errors import (
    AuthError,
    DeadlineExceededError,
    ProtocolError,
    UnavailableError,
    UnsupportedVersionError,
)
from kvfabric.protocol.frames import decode_body
from kvfabric.transport import auth

DESCRIPTOR_VERSION = 1
_DESCRIPTOR_PURPOSE = "kvfabric-transport-descriptor"


@dataclass(frozen=True)
class RegionInfo:
    """A registered region as peers see it (``address`` matters to one-sided backends only)."""

    region_id: int
    address: int
    nbytes: int


@dataclass(frozen=True)
class PeerDescriptor:
    """Everything a peer needs to reach a transport; :meth:`encode` is the wire form."""

    backend: str
    name: str
    regions: tuple[RegionInfo, ...]
    host: str = ""
    port: int = 0
    metadata: bytes = b""  # backend blob, e.g. NIXL agent metadata
    tls: bool = False  # the endpoint speaks TLS only (socket backend with peer TLS)

    def region(self, region_id: int) -> RegionInfo:
        for info in self.regions:
            if info.region_id == region_id:
                return info
        raise ProtocolError(f"peer {self.name!r} has no region {region_id}")

    def encode(self, secret: bytes | None) -> bytes:
        body = msgpack.packb(
            {
                "backend": self.backend,
                "name": self.name,
                "regions": [[r.region_id, r.address, r.nbytes] for r in self.regions],
                "host": self.host,
                "port": self.port,
                "metadata": self.metadata,
                "tls": self.tls,
            },
            use_bin_type=True,
        )
        packed: bytes = msgpack.packb(
            {
                "v": DESCRIPTOR_VERSION,
                "body": body,
                "mac": auth.sign(secret, _DESCRIPTOR_PURPOSE, body),
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def decode(cls, data: bytes, secret: bytes | None) -> PeerDescriptor:
        """Parse and authenticate; ``ProtocolError`` / ``AuthError`` on anything wrong."""
        outer = decode_body(data)
        if outer.get("v") != DESCRIPTOR_VERSION:
            raise UnsupportedVersionError(
                f"descriptor version {outer.get('v')!r}, this side speaks {DESCRIPTOR_VERSION}"
            )
        body = outer.get("body")
        if not isinstance(body, bytes):
            raise ProtocolError("descriptor without a body")
        auth.verify(secret, outer.get("mac"), _DESCRIPTOR_PURPOSE, body)
        fields = decode_body(body)
        try:
            regions = tuple(RegionInfo(int(r[0]), int(r[1]), int(r[2])) for r in fields["regions"])
            return cls(
                backend=str(fields["backend"]),
                name=str(fields["name"]),
                regions=regions,
                host=str(fields["host"]),
                port=int(fields["port"]),
                metadata=bytes(fields["metadata"]),
                tls=fields.get("tls") is True,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ProtocolError(f"malformed descriptor: {exc}") from None


@dataclass(frozen=True, eq=False)
class ReadPiece:
    """Pull ``len(local)`` bytes at ``remote_offset`` of the peer's ``remote_region``."""

    remote_region: int
    remote_offset: int
    local: Any  # writable C-contiguous buffer inside a locally registered region


@dataclass(frozen=True, eq=False)
class WritePiece:
    """Push ``local`` to ``remote_offset`` of the peer's ``remote_region``."""

    local: Any  # C-contiguous buffer inside a locally registered region
    remote_region: int
    remote_offset: int


class Peer:
    """A connected peer; backends add their connection state."""

    def __init__(self, descriptor: PeerDescriptor) -> None:
        self.descriptor = descriptor

    @property
    def name(self) -> str:
        return self.descriptor.name


def byte_view(buffer: Any, *, writable: bool) -> memoryview:
    """``buffer`` as a flat byte memoryview (``ValueError`` if not contiguous / writable)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("this buffer must be writable")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def address_of(view: memoryview) -> int:
    """Virtual address of a byte view's first byte."""
    if not len(view):
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def end_time(deadline: float) -> float:
    if deadline <= 0:
        raise DeadlineExceededError(f"deadline {deadline}s already passed")
    return time.monotonic() + deadline


def remaining(end: float, what: str) -> float:
    """Seconds left before ``end``; ``DeadlineExceededError`` naming ``what`` when none."""
    left = end - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"{what}: deadline passed")
    return left


class Transport(ABC):
    """Common bookkeeping (regions, secret, closed state); see the module contract."""

    backend: str = ""

    def __init__(self, name: str, *, secret: bytes | None = None) -> None:
        if not name:
            raise ValueError("a transport needs a non-empty name")
        self.name = name
        self._secret = secret or None
        self._lock = threading.Lock()
        self._regions: dict[int, memoryview] = {}
        self._closed = False

    # -- regions -----------------------------------------------------------------------------
    def register(self, region_id: int, buffer: Any) -> None:
        view = byte_view(buffer, writable=True)
        if not len(view):
            raise ValueError("cannot register an empty region")
        with self._lock:
            self._check_open()
            if region_id in self._regions:
                raise ValueError(f"region {region_id} is already registered")
            self._register(region_id, view)
            self._regions[region_id] = view

    def unregister(self, region_id: int) -> None:
        with self._lock:
            view = self._regions.pop(region_id, None)
            if view is None:
                raise KeyError(f"region {region_id} is not registered")
            self._unregister(region_id, view)

    def region_infos(self) -> tuple[RegionInfo, ...]:
        with self._lock:
            return tuple(
                RegionInfo(rid, address_of(v), len(v)) for rid, v in sorted(self._regions.items())
            )

    def region_view(self, region_id: int) -> memoryview | None:
        with self._lock:
            return self._regions.get(region_id)

    def local_region_of(self, view: memoryview) -> tuple[int, int]:
        """``(region_id, offset)`` of a local view; ``ValueError`` if it is not registered."""
        start = address_of(view)
        with self._lock:
            for rid, region in self._regions.items():
                base = address_of(region)
                if base <= start and start + len(view) <= base + len(region):
                    return rid, start - base
        raise ValueError(
            f"local buffer of {len(view)} bytes at {start:#x} is not inside a "
            "region registered on this transport"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"transport {self.name!r} is closed")

    def _decode_descriptor(self, data: bytes) -> PeerDescriptor:
        descriptor = PeerDescriptor.decode(data, self._secret)
        if descriptor.backend != self.backend:
            raise ProtocolError(
                f"peer {descriptor.name!r} uses the {descriptor.backend!r} "
                f"transport, this side {self.backend!r}"
            )
        if descriptor.name == self.name:
            raise AuthError(f"peer descriptor carries our own name {self.name!r}")
        return descriptor

    # -- backend hooks and operations ---------------------------------------------------------
    def _register(self, region_id: int, view: memoryview) -> None:
        """Backend hook, called under the lock before the region becomes visible."""

    def _unregister(self, region_id: int, view: memoryview) -> None:
        """Backend hook, called under the lock after the region was hidden."""

    @abstractmethod
    def descriptor(self) -> bytes: ...

    @abstractmethod
    def connect(self, peer_descriptor: bytes, deadline: float) -> Peer: ...

    @abstractmethod
    def read(self, peer: Peer, pieces: Sequence[ReadPiece], deadline: float) -> None: ...

    @abstractmethod
    def write(self, peer: Peer, pieces: Sequence[WritePiece], deadline: float) -> None: ...

    @abstractmethod
    def notify(self, peer: Peer, message: bytes, deadline: float) -> None: ...

    @abstractmethod
    def poll_notifications(self) -> list[tuple[str, bytes]]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
