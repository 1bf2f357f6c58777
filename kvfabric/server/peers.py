"""Links to peer nodes, shared by pulls (:mod:`kvfabric.server.puller`) and pushes
(:mod:`kvfabric.server.pusher`).

A link to one node incarnation is a TCP control session (with the cluster's admin token;
over TLS, with this node's certificate as the client certificate, when the TCP control plane
serves TLS: every node of a cluster has the same ``security.tls_planes``) plus a transport
peer, both found in the node's registration in the global index (its address and the
descriptor of the transport this node uses). Links are cached per node and
replaced when the node restarts (new epoch). Dropping a link closes its session, which makes
the peer give back every lease taken through it (pins, reservations).
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.client.connection import Connection
from kvfabric.cluster.index import NodeInfo
from kvfabric.errors import DeadlineExceededError, ProtocolError, UnavailableError
from kvfabric.memory.arena import SharedArena
from kvfabric.memory.pages import slice_pages
from kvfabric.server.cluster_link import ClusterLink
from kvfabric.transport import Peer, ReadPiece, Transport, WritePiece


@dataclass(frozen=True)
class PeerLink:
    """A cached link to one node incarnation."""

    epoch: int
    connection: Connection
    peer: Peer


# How long a node list may be reused. Registrations change only when nodes join, leave or
# restart; a link to an incarnation the cached list lacks is looked up afresh, and a failed
# link drops the list.
NODES_CACHE_S = 1.0


class PeerLinks:
    """Cache of :class:`PeerLink` per node id. Thread-safe; after :meth:`close` every
    :meth:`link` raises UnavailableError.

    ``token`` is presented to peers (the cluster's admin token when auth is on); ``tls``
    gives the client context for peers' TLS control endpoints, read once per new link (so a
    reloaded certificate is used from the next link on); None: plain TCP.
    """

    def __init__(
        self,
        cluster: ClusterLink,
        transport: Transport,
        token: str | None,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self.cluster = cluster
        self.transport = transport
        self._token = token
        self._tls = tls
        self._links: dict[str, PeerLink] = {}
        self._nodes: tuple[float, list[NodeInfo]] | None = None  # (good until, nodes)
        self._lock = threading.Lock()
        self._closed = False

    def nodes(self) -> list[NodeInfo]:
        """Registered nodes, as the index listed them at most :data:`NODES_CACHE_S` ago;
        none while the index is down (no peer can be found then)."""
        now = time.monotonic()
        with self._lock:
            cached = self._nodes
        if cached is not None and now < cached[0]:
            return cached[1]
        return self._fresh_nodes()

    def _fresh_nodes(self) -> list[NodeInfo]:
        try:
            nodes = self.cluster.index.nodes()
        except UnavailableError:
            return []
        with self._lock:
            self._nodes = (time.monotonic() + NODES_CACHE_S, nodes)
        return nodes

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
        info = _find(self.nodes(), node_id, epoch) or _find(self._fresh_nodes(), node_id, epoch)
        if info is None:
            raise UnavailableError(f"node {node_id} (epoch {epoch}) is no longer registered")
        descriptor = info.transports.get(self.transport.backend)
        if descriptor is None:
            raise UnavailableError(
                f"node {info.node_id} offers no {self.transport.backend!r} "
                f"transport (it has {sorted(info.transports)})"
            )
        host, _, port = info.address.rpartition(":")
        try:
            address = (host.strip("[]"), int(port))
            peer_descriptor = bytes.fromhex(descriptor)
        except ValueError:
            raise UnavailableError(
                f"node {info.node_id} advertises {info.address!r} and a "
                f"transport descriptor that cannot be used"
            ) from None
        try:
            connection = Connection(
                address,
                token=self._token,
                timeout=time_left(end, "connect"),
                tls=None if self._tls is None else self._tls(),
            )
        except OSError as exc:  # the hello timed out (a frozen peer), a TLS AuthError
            raise UnavailableError(f"cannot reach node {info.node_id}: {exc!r}") from None
        try:
            peer = self.transport.connect(peer_descriptor, time_left(end, "connect"))
        except BaseException:
            connection.close()
            raise
        return PeerLink(info.epoch, connection, peer)

    def forget(self, node_id: str) -> None:
        """Drop the cached link to ``node_id`` (the peer gives back its leases) and the cached
        node list (the node may have restarted or left)."""
        with self._lock:
            link = self._links.pop(node_id, None)
            self._nodes = None
        if link is not None:
            link.connection.close()

    def close(self) -> None:
        """Close every link (peers give back their leases); later links fail."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.connection.close()


def _find(nodes: list[NodeInfo], node_id: str, epoch: int) -> NodeInfo | None:
    return next((n for n in nodes if n.node_id == node_id and n.epoch == epoch), None)


def time_left(end: float, what: str) -> float:
    """Seconds before ``end`` (monotonic); DeadlineExceededError naming ``what`` when none."""
    left = end - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"deadline passed before {what}")
    return left


Range = tuple[int, int]  # (byte offset in a region, length)


def page_ranges(pages: Sequence[int], page_size: int, offset: int, length: int) -> list[Range]:
    """Byte ranges of bytes ``[offset, offset + length)`` of a chunk stored in ``pages`` of a
    region with pages of ``page_size``, adjacent pages merged: a fresh arena hands out runs
    of consecutive pages, and a transport moves one long range much faster than many."""
    out: list[list[int]] = []
    for start, n in slice_pages(
        lambda p, s, e: (int(p) * page_size + s, e - s), pages, page_size, offset, length
    ):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += n
        else:
            out.append([start, n])
    return [(start, n) for start, n in out]


def placement_ranges(
    item: dict[str, Any], nbytes: int, offset: int, length: int, what: str
) -> tuple[int, list[Range]]:
    """A peer's placement reply for a chunk (``tier``, ``pages``, ``page_size``, ``nbytes``)
    as (region id, byte ranges of bytes ``[offset, offset + length)`` of the chunk in that
    region). ProtocolError when the reply is malformed or the chunk is not ``nbytes`` long
    (the nodes disagree on the layout)."""
    try:
        # the arena the pages lie in (older daemons: the tier index, their only arena)
        region = int(item["arena"] if "arena" in item else item["tier"])
        page_size = int(item["page_size"])
        if int(item["nbytes"]) != nbytes or page_size <= 0:
            raise ValueError(
                f"{item['nbytes']} bytes in pages of {page_size}, this node expects {nbytes}"
            )
        pages = np.frombuffer(item["pages"], dtype="<u4").tolist()
        return region, page_ranges(pages, page_size, offset, length)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed {what} item: {exc}") from None


class Spans:
    """The pieces of one transfer between a peer's regions and this node's arenas, built
    chunk by chunk. A span that continues the previous one on both sides extends it, so the
    chunks of a chain that sit in consecutive pages on both nodes move as one piece."""

    def __init__(self, arenas: dict[int, SharedArena]) -> None:
        self._arenas = arenas
        # [remote region, remote offset, local region, local offset, length]
        self._spans: list[list[int]] = []

    def __bool__(self) -> bool:
        return bool(self._spans)

    def add(
        self,
        remote_region: int,
        remote: Sequence[Range],
        local_region: int | None,
        pages: Sequence[int],
        offset: int,
        length: int,
    ) -> None:
        """Pair ``remote`` (ranges of the peer's ``remote_region``) with bytes ``[offset,
        offset + length)`` of a local chunk in ``pages`` of arena ``local_region``; split
        where either side's range ends (page sizes may differ between nodes). A chunk in no
        arena (a device tier) is ``UnavailableError``: the transport cannot reach it."""
        if local_region is None:
            raise UnavailableError("the chunk is in a device tier, which peers cannot reach")
        local = iter(page_ranges(pages, self._arenas[local_region].page_size, offset, length))
        local_offset, local_left = 0, 0
        for remote_start, remote_length in remote:
            remote_offset, remote_left = remote_start, remote_length
            while remote_left:
                if not local_left:
                    local_offset, local_left = next(local)
                n = min(remote_left, local_left)
                self._append(remote_region, remote_offset, local_region, local_offset, n)
                remote_offset, remote_left = remote_offset + n, remote_left - n
                local_offset, local_left = local_offset + n, local_left - n

    def _append(
        self, remote_region: int, remote_offset: int, local_region: int, local_offset: int, n: int
    ) -> None:
        last = self._spans[-1] if self._spans else None
        if (
            last is not None
            and last[0] == remote_region
            and last[2] == local_region
            and last[1] + last[4] == remote_offset
            and last[3] + last[4] == local_offset
        ):
            last[4] += n
        else:
            self._spans.append([remote_region, remote_offset, local_region, local_offset, n])

    def reads(self) -> list[ReadPiece]:
        return [ReadPiece(r, ro, self._view(lr, lo, n)) for r, ro, lr, lo, n in self._spans]

    def writes(self) -> list[WritePiece]:
        return [WritePiece(self._view(lr, lo, n), r, ro) for r, ro, lr, lo, n in self._spans]

    def _view(self, region: int, offset: int, length: int) -> Any:
        # a slice of the registered arena array, so a transport can move it
        return self._arenas[region].array[offset : offset + length]
