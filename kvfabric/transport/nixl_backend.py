"""NIXL backend: one-sided READ (pull) / WRITE (push) over a NIXL agent with its UCX backend.

UCX picks RDMA where a NIC exists, else cross-memory attach / shared memory / TCP. The
descriptor carries this agent's NIXL metadata plus each region's address and size; ``connect``
loads the peer's metadata (``add_remote_agent``). A transfer is one ``initialize_xfer`` with
one descriptor per piece, so many pages move in one call. Pieces are bounds-checked against
the peer's descriptor before anything is posted (NIXL itself would only fail at the
remote key lookup, or not at all).

Deadlines: NIXL never gives up on a frozen peer, so ``read``/``write`` poll
``check_xfer_state`` until DONE, ERR (``UnavailableError``) or the deadline
(``DeadlineExceededError``); the transfer handle is released on every path so UCX stops
touching the local buffers.

Authentication: the descriptor is HMAC-signed when a cluster secret is set, so ``connect``
refuses a forged or foreign descriptor. UCX itself has no per-connection authentication; a
party that learns a descriptor's metadata can reach the registered memory — run it on a
trusted network. Nor does it encrypt: chunk bytes cross RDMA, shared memory or TCP in the
clear. With TLS between nodes (``security.tls_planes`` with ``peer``) the daemon uses the
socket backend instead (``transport: auto``) or refuses to start (``transport: nixl``).

Thread-safety: NIXL agent calls are serialised by a lock; polling releases it between
checks, so transfers from several threads overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvfabric.errors import KVFabricError, ProtocolError, UnavailableError
from kvfabric.transport.base import (
    Peer,
    PeerDescriptor,
    ReadPiece,
    Transport,
    WritePiece,
    address_of,
    byte_view,
    end_time,
    remaining,
)
from kvfabric.transport.nixl_module import nixl_api

_api = nixl_api()  # ImportError here, as from the import it replaces, when NIXL is missing
nixl_agent, nixl_agent_config = _api.nixl_agent, _api.nixl_agent_config

log = logging.getLogger(__name__)

_SPIN_S = 0.001  # poll without sleeping this long first: small transfers finish in µs
_POLL_SLEEP_S = 0.0002


def _check_remote(desc: PeerDescriptor, region_id: int, offset: int, length: int) -> int:
    """The remote address of a piece, or ``ProtocolError`` when it is outside the region."""
    region = desc.region(region_id)
    if offset < 0 or length <= 0 or offset + length > region.nbytes:
        raise ProtocolError(
            f"piece [{offset}, {offset + length}) outside region {region_id} "
            f"of {region.nbytes} bytes on {desc.name!r}"
        )
    return region.address + offset


class NixlTransport(Transport):
    """Transport over a NIXL agent (UCX backend); see the module docstring."""

    backend = "nixl"

    def __init__(self, name: str, *, secret: bytes | None = None) -> None:
        super().__init__(name, secret=secret)
        self._agent_lock = threading.Lock()
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._reg_handles: dict[int, Any] = {}
        self._remote_names: set[str] = set()

    def _register(self, region_id: int, view: memoryview) -> None:
        with self._agent_lock:
            self._reg_handles[region_id] = self._agent.register_memory(
                [(address_of(view), len(view), 0, "")], "DRAM"
            )

    def _unregister(self, region_id: int, view: memoryview) -> None:
        with self._agent_lock:
            self._agent.deregister_memory(self._reg_handles.pop(region_id))

    def descriptor(self) -> bytes:
        self._check_open()
        with self._agent_lock:
            metadata = self._agent.get_agent_metadata()
        return PeerDescriptor(
            self.backend, self.name, self.region_infos(), metadata=metadata
        ).encode(self._secret)

    def connect(self, peer_descriptor: bytes, deadline: float) -> Peer:
        self._check_open()
        end_time(deadline)  # add_remote_agent only loads metadata: it does not block on the peer
        desc = self._decode_descriptor(peer_descriptor)
        with self._agent_lock:
            if desc.name in self._remote_names:  # refresh: new regions, new metadata
                self._agent.remove_remote_agent(desc.name)
                self._remote_names.discard(desc.name)
            try:
                self._agent.add_remote_agent(desc.metadata)
            except Exception as exc:  # nixl raises its own binding types
                raise UnavailableError(
                    f"cannot load NIXL metadata of {desc.name!r}: {exc}"
                ) from None
            self._remote_names.add(desc.name)
        return Peer(desc)

    def read(self, peer: Peer, pieces: Sequence[ReadPiece], deadline: float) -> None:
        views = [byte_view(p.local, writable=True) for p in pieces]
        remote = [
            (_check_remote(peer.descriptor, p.remote_region, p.remote_offset, len(v)), len(v), 0)
            for p, v in zip(pieces, views)
        ]
        self._transfer("READ", peer, views, remote, deadline)

    def write(self, peer: Peer, pieces: Sequence[WritePiece], deadline: float) -> None:
        views = [byte_view(p.local, writable=False) for p in pieces]
        remote = [
            (_check_remote(peer.descriptor, p.remote_region, p.remote_offset, len(v)), len(v), 0)
            for p, v in zip(pieces, views)
        ]
        self._transfer("WRITE", peer, views, remote, deadline)

    def _transfer(
        self,
        op: str,
        peer: Peer,
        views: list[memoryview],
        remote: list[tuple[int, int, int]],
        deadline: float,
    ) -> None:
        self._check_open()
        if not views:
            raise ValueError("a transfer needs at least one piece")
        end = end_time(deadline)
        for view in views:
            self.local_region_of(view)
        local = [(address_of(v), len(v), 0) for v in views]
        handle = None
        try:
            with self._agent_lock:
                handle = self._agent.initialize_xfer(
                    op,
                    self._agent.get_xfer_descs(local, "DRAM"),
                    self._agent.get_xfer_descs(remote, "DRAM"),
                    peer.name,
                )
                state = self._agent.transfer(handle)
            spin_until = time.monotonic() + _SPIN_S
            while state not in ("DONE", "ERR"):
                remaining(end, f"NIXL {op} with {peer.name!r}")
                if time.monotonic() > spin_until:
                    time.sleep(_POLL_SLEEP_S)
                with self._agent_lock:
                    state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise UnavailableError(f"NIXL {op} with {peer.name!r} failed")
        except KVFabricError:
            raise
        except Exception as exc:  # nixl raises its binding's types, e.g. on a dead peer
            raise UnavailableError(f"NIXL {op} with {peer.name!r} failed: {exc}") from None
        finally:
            if handle is not None:
                self._release(handle)

    def _release(self, handle: Any) -> None:
        with self._agent_lock:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:  # a still-posted transfer may refuse; log, do not mask
                log.warning("transport %s: could not release a NIXL transfer: %s", self.name, exc)

    def notify(self, peer: Peer, message: bytes, deadline: float) -> None:
        self._check_open()
        end_time(deadline)  # send_notif posts and returns: it never waits on the peer
        try:
            with self._agent_lock:
                self._agent.send_notif(peer.name, bytes(message))
        except Exception as exc:
            raise UnavailableError(f"NIXL notify to {peer.name!r} failed: {exc}") from None

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        self._check_open()
        with self._agent_lock:
            received = self._agent.get_new_notifs()
        return [(name, message) for name, messages in received.items() for message in messages]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions, self._regions = self._regions, {}
        with self._agent_lock:
            for name in self._remote_names:
                self._agent.remove_remote_agent(name)
            self._remote_names.clear()
            for region_id in regions:
                self._agent.deregister_memory(self._reg_handles.pop(region_id))
