"""Links to peer nodes, shared by pulls (:mod:`kvfabric.server.puller`) and pushes
(:mod:`kvfabric.server.pusher`).

A link to one node incarnation is a TCP control session (with the cluster's admin token)
plus a transport peer, both found in the node's registration in the global index (its
address and the descriptor of the transport this node uses). Links are cached per node and
replaced when the node restarts (new epoch). Dropping a link closes its session, which makes
the peer give back every lease taken through it (pins, reservations).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.client.connection import Connection
from kvfabric.cluster.index import NodeInfo
from kvfabric.errors import DeadlineExceededError, ProtocolError, UnavailableError
from kvfabric.memory.arena import SharedArena
from kvfabric.memory.pages import slice_pages
from kvfabric.server.cluster_link import ClusterLink
from kvfabric.transport import Peer, Transport


@dataclass(frozen=True)
class PeerLink:
    """A cached link to one node incarnation."""

    epoch: int
    connection: Connection
    peer: Peer


class PeerLinks:
    """Cache of :class:`PeerLink` per node id. Thread-safe; after :meth:`close` every
    :meth:`link` raises UnavailableError.

    ``token`` is presented to peers (the cluster's admin token when auth is on).
    """

    def __init__(self, cluster: ClusterLink, transport: Transport, token: str | None) -> None:
        self.cluster = cluster
        self.transport = transport
        self._token = token
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        self._closed = False

    def nodes(self) -> list[NodeInfo]:
        """Registered nodes; none while the index is down (no peer can be found then)."""
        try:
            return self.cluster.index.nodes()
        except UnavailableError:
            return []

    def link(self, node_id: str, epoch: int, end: float) -> PeerLink:
        """The link to incarnation ``epoch`` of ``node_id``, connecting before ``end``
        (monotonic) if none is cached. UnavailableError / DeadlineExceededError otherwise."""
        with self._lock:
            if self._closed:
                raise UnavailableError("this node is shutting down")
            cached = self._links.get(node_id)
        if cached is not None and cached.epoch == epoch and not cached.connection.closed:
            return cached
        self.forget(node_id)
        link = self._connect(node_id, epoch, end)
        with self._lock:
            current = self._links.get(node_id)
            if self._closed or (current is not None and current.epoch == link.epoch):
                link.connection.close()  # another thread connected first, or closing
                if current is None:
                    raise UnavailableError("this node is shutting down")
                return current
            self._links[node_id] = link
        return link

    def _connect(self, node_id: str, epoch: int, end: float) -> PeerLink:
        info = next((n for n in self.nodes() if n.node_id == node_id and n.epoch == epoch),
                    None)
        if info is None:
            raise UnavailableError(f"node {node_id} (epoch {epoch}) is no longer registered")
        descriptor = info.transports.get(self.transport.backend)
        if descriptor is None:
            raise UnavailableError(f"node {info.node_id} offers no {self.transport.backend!r} "
                                   f"transport (it has {sorted(info.transports)})")
        host, _, port = info.address.rpartition(":")
        try:
            address = (host.strip("[]"), int(port))
            peer_descriptor = bytes.fromhex(descriptor)
        except ValueError:
            raise UnavailableError(f"node {info.node_id} advertises {info.address!r} and a "
                                   f"transport descriptor that cannot be used") from None
        try:
            connection = Connection(address, token=self._token,
                                    timeout=time_left(end, "connect"))
        except OSError as exc:  # the hello timed out: a frozen peer
            raise UnavailableError(f"cannot reach node {info.node_id}: {exc!r}") from None
        try:
            peer = self.transport.connect(peer_descriptor, time_left(end, "connect"))
        except BaseException:
            connection.close()
            raise
        return PeerLink(info.epoch, connection, peer)

    def forget(self, node_id: str) -> None:
        """Drop the cached link to ``node_id``: the peer gives back its leases."""
        with self._lock:
            link = self._links.pop(node_id, None)
        if link is not None:
            link.connection.close()

    def close(self) -> None:
        """Close every link (peers give back their leases); later links fail."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.connection.close()


def pair_ranges(remote: Sequence[tuple[int, int]], local: Sequence[Any]
                ) -> list[tuple[int, Any]]:
    """Pair byte ranges ``(offset, length)`` of a peer's region with local views covering
    as many bytes, split at both sides' page boundaries (page sizes may differ between
    nodes): ``[(remote_offset, local_view), ...]``."""
    out: list[tuple[int, Any]] = []
    views = iter(local)
    view = next(views)
    for offset, length in remote:
        while length:
            if not len(view):
                view = next(views)
            n = min(length, len(view))
            out.append((offset, view[:n]))
            view, offset, length = view[n:], offset + n, length - n
    return out


def time_left(end: float, what: str) -> float:
    """Seconds before ``end`` (monotonic); DeadlineExceededError naming ``what`` when none."""
    left = end - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"deadline passed before {what}")
    return left


def placement_ranges(item: dict[str, Any], nbytes: int, offset: int, length: int,
                     what: str) -> tuple[int, list[tuple[int, int]]]:
    """A peer's placement reply for a chunk (``tier``, ``pages``, ``page_size``, ``nbytes``)
    as (region id, byte ranges of bytes ``[offset, offset + length)`` of the chunk in that
    region). ProtocolError when the reply is malformed or the chunk is not ``nbytes`` long
    (the nodes disagree on the layout)."""
    try:
        region, page_size = int(item["tier"]), int(item["page_size"])
        if int(item["nbytes"]) != nbytes or page_size <= 0:
            raise ValueError(f"{item['nbytes']} bytes in pages of {page_size}, this node "
                             f"expects {nbytes}")
        pages = np.frombuffer(item["pages"], dtype="<u4").tolist()
        return region, slice_pages(lambda p, s, e: (p * page_size + s, e - s), pages,
                                   page_size, offset, length)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed {what} item: {exc}") from None


def arena_views(arena: SharedArena, pages: Sequence[int], offset: int, length: int
                ) -> list[Any]:
    """Views of bytes ``[offset, offset + length)`` of a chunk in ``pages`` of ``arena``:
    slices of the registered arena array, so a transport can move them."""
    array, size = arena.array, arena.page_size
    return slice_pages(lambda p, s, e: array[p * size + s:p * size + e], pages, size, offset,
                       length)
