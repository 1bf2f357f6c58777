"""Pulling chunks this node lacks from the nodes that own them (the ``prefetch`` op).

For a chain of keys, :meth:`Puller.prefetch` asks the global index who holds what, skips the
chunks held here, and pulls the rest from one owner at a time, longest prefix first (ties:
more of the chunks in the owner's fastest tier). Each owner gets an even share of the time
left, so a frozen one leaves time for the next. One pull from one owner is:

1. ``peer_pin`` over the owner's TCP control endpoint: the owner pins the chunks (reading
   SSD copies back into memory first) and answers with their tier, page ids and page size
   (and their token ids, which the local copies keep);
2. reserve each chunk in this node's store, map every remote page range onto the local
   pages (page sizes may differ between the nodes; ranges adjacent on both sides merge into
   one piece) and move everything with one transport ``read`` into this node's arena;
3. commit the local copies, but only if the read finished before the owner's pins could
   expire (after that the owner may have reused the pages: the copy could be torn);
4. ``peer_release`` the pins.

fp8 on the wire (:mod:`kvfabric.server.wire_fp8`): from an owner ``cluster.fp8_wire_peers``
names (by node id or hardware class), ``peer_pin`` asks ``wire: fp8``; a chunk the owner
staged encoded is read from its staging into this node's, checked against its checksum and
decoded into the local reservation; one it did not stage (or this node has no room for)
is read from its pages as they are.

Any failure (owner gone or frozen, deadline, error reply) aborts the local reservations, so
no page stays taken here, and drops the cached connection to that owner: the owner's session
then ends and gives its pins back even if the release never arrived. The chunks are then
tried on the next owner that holds them; what no owner could supply is reported missing.

Thread-safe: prefetches run on the daemon's worker threads, several at once. Connections
(control session and transport peer) are the daemon's :class:`~kvfabric.server.peers.PeerLinks`,
cached per owner node and replaced when the owner restarts (new epoch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfabric.client.requests import item_results
from kvfabric.cluster.index import GlobalLookup
from kvfabric.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    KVFabricError,
    LeaseExpiredError,
    ProtocolError,
)
from kvfabric.protocol.messages import Op, encode_namespace
from kvfabric.server.peers import PeerLink, PeerLinks, Spans, placement_ranges
from kvfabric.server.wire_fp8 import (
    FP8,
    NO_FP8,
    STAGING_REGION,
    Fp8Targets,
    Staged,
    WireStaging,
    land_chunk,
    transfer_regions,
    wire_applies,
)
from kvfabric.spec import Namespace
from kvfabric.store.handles import ObjectWriter
from kvfabric.store.protocol import Store

log = logging.getLogger(__name__)

# Time a release may take after the pull's deadline: the release only frees the owner's pages
# early (closing the connection frees them too), so it must not stretch the deadline much.
RELEASE_GRACE_S = 0.5


@dataclass(frozen=True)
class PrefetchResult:
    """Outcome of one prefetch: chunks copied here, held here already, found nowhere (or not
    pulled in time), and the node the copied chunks came from (the first, if several).
    ``pulled_tokens`` (the copied chunks' tokens) is for the metrics, not the reply."""

    pulled: int
    already_local: int
    missing: int
    source: str | None
    pulled_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "pulled": self.pulled,
            "already_local": self.already_local,
            "missing": self.missing,
            "source": self.source,
        }


@dataclass(frozen=True)
class _Candidate:
    node_id: str
    epoch: int
    held: tuple[int, ...]  # indices of the wanted chunks this node holds
    rank: tuple[int, int, str]  # sort key: longest prefix, then most in its fastest tier


class Puller:
    """Pulls chunks into ``store`` (see the module docstring).

    ``links.transport`` must have every host arena of ``store`` registered under its arena
    id (:meth:`TieredStore.host_arenas`). Closing ``links`` makes later prefetches find no
    owner.
    """

    def __init__(
        self,
        store: Store,
        links: PeerLinks,
        *,
        staging: WireStaging | None = None,
        fp8_from: Fp8Targets = NO_FP8,
    ) -> None:
        """``staging``: this node's fp8 staging arena, registered with ``links.transport``
        as :data:`~kvfabric.server.wire_fp8.STAGING_REGION` (None: pulls are native);
        ``fp8_from``: the owners pulls from travel as fp8."""
        self._store = store
        self._links = links
        self._cluster = links.cluster
        self._transport = links.transport
        self._arenas = transfer_regions({i: a for i, _, a in store.host_arenas()}, staging)
        self._staging = staging
        self._fp8_from = fp8_from

    def prefetch(self, ns: Namespace, keys: Sequence[bytes], timeout: float) -> PrefetchResult:
        """Pull every chunk of ``keys`` not held here, within ``timeout`` seconds.

        Never raises for an owner's failure, nor once this node is closing: chunks that
        could not be pulled count as missing.
        """
        end = time.monotonic() + timeout
        local = [self._store.contains(ns, key) for key in keys]
        wanted = {i for i, here in enumerate(local) if not here}
        already_local = len(keys) - len(wanted)
        pulled, pulled_tokens, source = 0, 0, None
        if wanted:
            found = self._cluster.lookup(ns, keys)
            candidates = self._candidates(found, wanted)
            for n, candidate in enumerate(candidates):
                todo = [i for i in candidate.held if i in wanted]
                now = time.monotonic()
                if not todo or now >= end:
                    continue
                # a frozen owner must leave time for the next ones: split what is left evenly
                others = sum(1 for c in candidates[n + 1 :] if wanted.intersection(c.held))
                try:
                    copied, raced = self._pull(
                        candidate, ns, [keys[i] for i in todo], now + (end - now) / (1 + others)
                    )
                except KVFabricError as exc:
                    log.warning(
                        "pulling %d chunk(s) from %s failed: %s", len(todo), candidate.node_id, exc
                    )
                    self._links.forget(candidate.node_id)
                    continue
                wanted -= {i for i in todo if keys[i] in copied or keys[i] in raced}
                pulled += len(copied)
                pulled_tokens += sum(copied.values())
                already_local += len(raced)
                if copied and source is None:
                    source = candidate.node_id
        return PrefetchResult(pulled, already_local, len(wanted), source, pulled_tokens)

    def _candidates(self, found: GlobalLookup, wanted: set[int]) -> list[_Candidate]:
        """Other nodes holding any wanted chunk, best first."""
        tiers = {info.node_id: info.tiers for info in self._links.nodes()}
        held: dict[tuple[str, int], list[int]] = {}
        fast: dict[tuple[str, int], int] = {}
        for i, copies in enumerate(found.owners):
            for loc in copies:
                node = (loc.node_id, loc.epoch)
                if loc.node_id == self._cluster.node_id or i not in wanted:
                    continue
                if not held.get(node) or held[node][-1] != i:  # a chunk in two tiers: once
                    held.setdefault(node, []).append(i)
                if tiers.get(loc.node_id, ())[:1] == (loc.tier,):
                    fast[node] = fast.get(node, 0) + 1
        prefixes = {node.node_id: node.chunks for node in found.nodes().values()}
        out = [
            _Candidate(
                node_id,
                epoch,
                tuple(indices),
                (-prefixes.get(node_id, 0), -fast.get((node_id, epoch), 0), node_id),
            )
            for (node_id, epoch), indices in held.items()
        ]
        return sorted(out, key=lambda c: c.rank)

    # -- one owner ------------------------------------------------------------------------
    def _pull(
        self, candidate: _Candidate, ns: Namespace, keys: list[bytes], end: float
    ) -> tuple[dict[bytes, int], set[bytes]]:
        """Copy ``keys`` from one owner; returns (copied keys and their tokens, keys that
        appeared here meanwhile). Raises KVFabricError when nothing could be copied from
        this owner."""
        owner = self._links.link(candidate.node_id, candidate.epoch, end)
        pinned_at = time.monotonic()
        args = {"ns": encode_namespace(ns), "keys": keys, "timeout": _left(end, "peer_pin")}
        if self._wants_fp8(candidate.node_id, ns):
            args["wire"] = FP8
        items = item_results(
            owner.connection.call(Op.PEER_PIN, args, timeout=_left(end, "peer_pin"))
        )
        leases = [r["lease"] for r in items if not isinstance(r, KVFabricError)]
        writers: list[tuple[bytes, ObjectWriter]] = []
        encoded: list[tuple[ObjectWriter, Staged, Any]] = []
        raced: set[bytes] = set()
        try:
            spans = Spans(self._arenas)
            lease_s = float("inf")
            for key, item in zip(keys, items):
                if isinstance(item, KVFabricError):
                    continue  # the owner lost this chunk: it stays wanted
                try:
                    writer = self._store.reserve(
                        ns,
                        key,
                        parent=item["parent"],
                        num_tokens=item["num_tokens"],
                        tokens=item.get("tokens"),  # the copy keeps them (checked here too)
                    )
                except AlreadyExistsError:
                    raced.add(key)  # stored here since the check
                    continue
                writers.append((key, writer))
                lease_s = min(lease_s, float(item["lease_s"]))
                room = self._room_for(item.get("staging"))
                if room is not None:  # its encoded bytes, into this node's staging
                    encoded.append((writer, room, item["staging"].get("checksum")))
                    region, remote = placement_ranges(
                        item["staging"], room.nbytes, 0, room.nbytes, "peer_pin staging"
                    )
                    spans.add(region, remote, STAGING_REGION, room.pages, 0, room.nbytes)
                    continue
                region, remote = placement_ranges(item, writer.nbytes, 0, writer.nbytes, "peer_pin")
                spans.add(region, remote, writer.arena_id, writer.pages, 0, writer.nbytes)
            if spans:  # every chunk from this owner in one transfer
                self._transport.read(owner.peer, spans.reads(), _left(end, "transfer"))
                if time.monotonic() >= pinned_at + lease_s:
                    raise LeaseExpiredError("the owner's pins expired during the transfer")
            assert self._staging is not None or not encoded
            for writer, room, checksum in encoded:
                land_chunk(self._staging, room, writer, checksum)  # type: ignore[arg-type]
            for _, writer in writers:
                writer.commit()
        except BaseException:
            for _, writer in writers:
                writer.abort()  # no-op for one already committed
            raise  # the caller drops the connection, which gives the owner's pins back
        finally:
            for _, room, _ in encoded:
                self._staging.give(room)  # type: ignore[union-attr]
        self._release(candidate.node_id, owner, leases, end)
        return {key: writer.num_tokens for key, writer in writers}, raced

    def _wants_fp8(self, node_id: str, ns: Namespace) -> bool:
        if self._staging is None or not wire_applies(ns.spec):
            return False
        node = next((n for n in self._links.nodes() if n.node_id == node_id), None)
        return self._fp8_from.wire_for(node_id, "" if node is None else node.hardware_class) == FP8

    def _room_for(self, staging: Any) -> Staged | None:
        """Room here for a chunk the owner staged as fp8 (None: it was not, or no room)."""
        if self._staging is None or not isinstance(staging, dict):
            return None
        try:
            return self._staging.take(int(staging["nbytes"]))
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("malformed peer_pin staging item") from None

    def _release(self, node_id: str, owner: PeerLink, leases: list[int], end: float) -> None:
        if not leases:
            return
        try:
            owner.connection.call(
                Op.PEER_RELEASE,
                {"leases": leases},
                timeout=max(end - time.monotonic(), 0) + RELEASE_GRACE_S,
            )
        except KVFabricError as exc:
            # dropping the session gives the pins back on the owner's side
            log.info("releasing pins on %s failed (%s); dropping the connection", node_id, exc)
            self._links.forget(node_id)


def _left(end: float, what: str) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"prefetch: deadline passed before {what}")
    return left
