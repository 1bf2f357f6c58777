"""Pushing chunks to a chosen node as their layers are committed (the ``push`` op).

A prefill node pushes the chunks it is computing to the decode node a router picked, layer
by layer, so the decode node's readers can start on layer 0 while later layers are still
being computed or in flight. One push is:

1. pin every chunk here (``store.get``: a chunk still being written is fine, its pin lasts
   the whole push);
2. ``peer_reserve`` every chunk (with its token ids, when it has them) on the target in one
   request, over its TCP control endpoint: the target answers with the reservation's tier,
   pages, page size and lease; a chunk the target already holds (or is receiving from
   elsewhere) counts as already there. From now on the chunks exist on the target: its
   readers may ``get`` them and wait on layers;
3. layer by layer: wait until the next layer is committed here, for every chunk; move it,
   together with every later layer all of them have committed already, with one transport
   ``write`` into the target's pages (adjacent pages merged; page sizes may differ between
   the nodes); then one ``peer_commit`` with those layers' bits for all of them, which wakes
   the target's readers waiting on them. A chunk computed already thus moves in one
   transfer and one commit, one being computed as each layer comes;
4. give the local pins back.

The reply says how far the push kept up with the chunks' producer: the share of layers
landed on the target when the last one was committed here, and the tail after it
(:mod:`kvfabric.server.push_timeline`); and the bytes moved against what they are in the
namespace's dtype.

fp8 on the wire (:mod:`kvfabric.server.wire_fp8`): when the push asks for it (or
``cluster.fp8_wire_peers`` names the target or its hardware class), a chunk of a float
namespace goes encoded: staged here, reserved with ``wire: fp8``, each layer batch encoded
into this node's staging and written into the target's, committed with its checksum; the
target decodes it into the reservation. A chunk either side has no staging room for goes
native.

The target's reservations are leases of the push's control session. Nothing is written
after the shortest of them could have expired (the target may have reused the pages): the
push stops and fails instead. On any failure (target gone or frozen, deadline, a local
chunk aborted) the push aborts its reservations (``peer_abort``; should that fail too, the
cached connection is dropped, which ends the session and aborts them on the target's side)
and reports the chunks as failed. A chunk whose own local wait fails is dropped alone.

Thread-safe: pushes run on the daemon's worker threads, several at once, sharing the
daemon's :class:`~kvfabric.server.peers.PeerLinks`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfabric.client.requests import item_results
from kvfabric.errors import AlreadyExistsError, KVFabricError, ProtocolError, UnavailableError
from kvfabric.protocol.messages import Op, encode_namespace
from kvfabric.server.peers import PeerLink, PeerLinks, Spans, placement_ranges, time_left
from kvfabric.server.push_timeline import PushTimeline, TimelineRecorder
from kvfabric.server.wire_fp8 import (
    FP8,
    NO_FP8,
    STAGING_REGION,
    Fp8Targets,
    Staged,
    WireStaging,
    encode_layers,
    encoded_nbytes,
    transfer_regions,
    wire_applies,
)
from kvfabric.spec import Namespace
from kvfabric.store.handles import ObjectReader
from kvfabric.store.protocol import Store

log = logging.getLogger(__name__)

# Time an abort may take after the push's deadline: it only frees the target's pages early
# (dropping the connection frees them too), so it must not stretch the deadline much.
ABORT_GRACE_S = 0.5
# Share of the target's reservation lease a push uses: margin for the last write's transit.
LEASE_SAFETY = 0.9
# A local pin outlives the push by this much, so it cannot lapse while a write reads it.
PIN_MARGIN_S = 5.0


@dataclass(frozen=True)
class PushResult:
    """Outcome of one push, in distinct chunks: fully committed on the target, held (or
    being received) there already, and not pushed (not held here, refused, or failed);
    ``target_class`` is the target's declared hardware class ("" when it is unknown);
    ``timeline`` how the moved layers kept up with their producer (None: none moved);
    ``wire_bytes`` what the transport moved, ``native_bytes`` what that was in the
    namespace's dtype (equal unless chunks went as fp8)."""

    pushed: int
    already_there: int
    failed: int
    target_class: str = ""
    timeline: PushTimeline | None = field(default=None, compare=False)
    wire_bytes: int = 0
    native_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        reply: dict[str, Any] = {
            "pushed": self.pushed,
            "already_there": self.already_there,
            "failed": self.failed,
            "target_class": self.target_class,
            "wire_bytes": self.wire_bytes,
            "native_bytes": self.native_bytes,
        }
        if self.timeline is not None:
            reply.update(self.timeline.summary())
        return reply


@dataclass
class _Chunk:
    """One chunk on its way: the local pin and the target's reservation."""

    key: bytes
    reader: ObjectReader
    lease: int
    region: int
    placement: dict[str, Any]
    # travelling as fp8: this node's staging room and the target's (its ``staging`` reply)
    staged: Staged | None = None
    target_staging: dict[str, Any] | None = None


class Pusher:
    """Pushes chunks of ``store`` to other nodes (see the module docstring).

    ``links.transport`` must have every host arena of ``store`` registered under its arena
    id (:meth:`TieredStore.host_arenas`). Closing ``links`` makes later pushes fail.
    """

    def __init__(
        self,
        store: Store,
        links: PeerLinks,
        clock: Callable[[], float] = time.monotonic,
        *,
        staging: WireStaging | None = None,
        fp8_to: Fp8Targets = NO_FP8,
    ) -> None:
        """``staging``: this node's fp8 staging arena, registered with ``links.transport``
        as :data:`~kvfabric.server.wire_fp8.STAGING_REGION` (None: every push is native);
        ``fp8_to``: the targets pushes go to as fp8 unless a push says otherwise."""
        self._store = store
        self._links = links
        self._clock = clock  # the timeline's; deadlines keep time.monotonic
        self._arenas = transfer_regions({i: a for i, _, a in store.host_arenas()}, staging)
        self._staging = staging
        self._fp8_to = fp8_to

    def push(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        target: str,
        timeout: float,
        *,
        wire: str | None = None,
    ) -> PushResult:
        """Push ``keys`` to node ``target`` within ``timeout`` seconds, each layer as soon as
        it is committed here; ``wire`` ("fp8" or "native"; None: as configured) is how.

        ProtocolError if ``target`` is this node. Never raises for the target's failure, a
        missing local chunk or the deadline: such chunks count as failed.
        """
        if target == self._links.cluster.node_id:
            raise ProtocolError("push: the target is this node")
        end = time.monotonic() + timeout
        node = next((n for n in self._links.nodes() if n.node_id == target), None)
        target_class = "" if node is None else node.hardware_class
        if wire is None:
            wire = self._fp8_to.wire_for(target, target_class)
        fp8 = wire == FP8 and self._staging is not None and wire_applies(ns.spec)
        wanted = list(dict.fromkeys(keys))  # a key twice would be reserved twice
        readers: dict[bytes, ObjectReader] = {}
        try:
            for key in wanted:
                try:
                    readers[key] = self._store.get(
                        ns, key, timeout=time_left(end, "pin"), lease_s=timeout + PIN_MARGIN_S
                    )
                except KVFabricError as exc:
                    log.info("push: chunk %s not pushed: %s", key.hex(), exc)
            pushed = already = 0
            recorder = TimelineRecorder(self._clock)
            moved = _Moved()
            if readers:
                try:
                    if node is None:
                        raise UnavailableError(f"node {target} is not registered")
                    pushed, already = self._push(
                        ns, readers, target, node.epoch, end, recorder, moved, fp8
                    )
                except KVFabricError as exc:
                    log.warning("pushing %d chunk(s) to %s failed: %s", len(readers), target, exc)
            timeline: PushTimeline | None = recorder.timeline() if pushed else None
            return PushResult(
                pushed,
                already,
                len(wanted) - pushed - already,
                target_class,
                timeline,
                moved.wire,
                moved.native,
            )
        finally:
            for reader in readers.values():
                reader.release()

    def _push(
        self,
        ns: Namespace,
        readers: dict[bytes, ObjectReader],
        target: str,
        epoch: int,
        end: float,
        recorder: TimelineRecorder,
        moved: _Moved,
        fp8: bool,
    ) -> tuple[int, int]:
        """(pushed, already there); raises KVFabricError when the push failed as a whole
        (what it reserved is aborted by then). Notes each moved batch in ``recorder``."""
        link = self._links.link(target, epoch, end)
        staged: dict[bytes, Staged] = {}
        try:
            if fp8:
                staged = self._stage(readers)
            return self._reserve_and_move(ns, readers, target, link, end, recorder, moved, staged)
        finally:
            for room in staged.values():
                self._staging.give(room)  # type: ignore[union-attr]

    def _stage(self, readers: dict[bytes, ObjectReader]) -> dict[bytes, Staged]:
        """Staging room here for every chunk it fits (the others go native)."""
        assert self._staging is not None
        staged = {}
        for key, reader in readers.items():
            room = self._staging.take(encoded_nbytes(reader.layout.spec, reader.num_tokens))
            if room is not None:
                staged[key] = room
        return staged

    def _reserve_and_move(
        self,
        ns: Namespace,
        readers: dict[bytes, ObjectReader],
        target: str,
        link: PeerLink,
        end: float,
        recorder: TimelineRecorder,
        moved: _Moved,
        staged: dict[bytes, Staged],
    ) -> tuple[int, int]:
        items = [_reserve_item(key, reader, key in staged) for key, reader in readers.items()]
        reserved_at = time.monotonic()
        try:
            replies = item_results(
                link.connection.call(
                    Op.PEER_RESERVE,
                    {"ns": encode_namespace(ns), "items": items},
                    timeout=time_left(end, "peer_reserve"),
                )
            )
        except KVFabricError:
            self._links.forget(target)  # the target may have reserved: its session aborts
            raise
        chunks: list[_Chunk] = []
        already = 0
        lease_end = end
        for (key, reader), reply in zip(readers.items(), replies):
            if isinstance(reply, AlreadyExistsError):
                already += 1
            elif isinstance(reply, KVFabricError):
                log.info("push: %s refused %s: %s", target, key.hex(), reply)
            else:
                target_staging = reply.get("staging") if key in staged else None
                chunks.append(
                    _Chunk(
                        key,
                        reader,
                        int(reply["lease"]),
                        int(reply.get("arena", reply["tier"])),
                        reply,
                        staged.get(key) if target_staging is not None else None,
                        target_staging,
                    )
                )
                lease_end = min(lease_end, reserved_at + float(reply["lease_s"]) * LEASE_SAFETY)
        try:
            layer = 0
            while layer < ns.spec.num_layers and chunks:
                chunks, layer = self._push_layers(
                    link, chunks, layer, lease_end, target, recorder, moved
                )
        except BaseException:
            self._abort(link, target, chunks, end)
            raise
        return len(chunks), already

    def _push_layers(
        self,
        link: PeerLink,
        chunks: list[_Chunk],
        first: int,
        end: float,
        target: str,
        recorder: TimelineRecorder,
        moved: _Moved,
    ) -> tuple[list[_Chunk], int]:
        """Wait for layer ``first`` of every chunk, then move and commit it together with
        every later layer that all of them have committed already: one transfer and one
        commit however many layers are ready, yet layer by layer while they are being
        computed. Returns the chunks still going (a chunk whose local layer never came, or
        whose commit the target refused, is dropped) and the next layer to push."""
        ready: list[_Chunk] = []
        common = -1
        waited = not all(chunk.reader.ready_mask >> first & 1 for chunk in chunks)
        for chunk in chunks:
            try:
                chunk.reader.wait_layer(first, time_left(end, f"layer {first}"))
            except KVFabricError as exc:
                log.info("push: layer %d of %s never came: %s", first, chunk.key.hex(), exc)
                self._abort(link, target, [chunk], end)
                continue
            ready.append(chunk)
            common &= chunk.reader.ready_mask
        if not ready:
            return ready, first
        ready_at = recorder.seen(waited)
        num_layers = ready[0].reader.layout.spec.num_layers
        stop = first + 1
        while stop < num_layers and common >> stop & 1:
            stop += 1
        spans = Spans(self._arenas)
        checksums: list[int | None] = []
        for chunk in ready:
            layout = chunk.reader.layout
            offset = layout.layer_range(first)[0]
            last_offset, last_length = layout.layer_range(stop - 1)
            length = last_offset + last_length - offset  # layers lie one after the other
            moved.native += length
            if chunk.staged is None or chunk.target_staging is None:
                region, remote = placement_ranges(
                    chunk.placement, chunk.reader.nbytes, offset, length, "peer_reserve"
                )
                spans.add(region, remote, chunk.reader.arena_id, chunk.reader.pages, offset, length)
                checksums.append(None)
                moved.wire += length
                continue
            assert self._staging is not None
            offset, length, checksum = encode_layers(
                self._staging, chunk.staged, chunk.reader, first, stop
            )
            region, remote = placement_ranges(
                chunk.target_staging, chunk.staged.nbytes, offset, length, "peer_reserve staging"
            )
            spans.add(region, remote, STAGING_REGION, chunk.staged.pages, offset, length)
            checksums.append(checksum)
            moved.wire += length
        layers = f"layers {first}-{stop - 1}"
        self._links.transport.write(link.peer, spans.writes(), time_left(end, f"write of {layers}"))
        commit: dict[str, Any] = {
            "leases": [c.lease for c in ready],
            "layers": (1 << stop) - (1 << first),
        }
        if any(c is not None for c in checksums):
            commit["checksums"] = checksums
        try:
            replies = item_results(
                link.connection.call(Op.PEER_COMMIT, commit, timeout=time_left(end, "peer_commit"))
            )
        except KVFabricError:
            self._links.forget(target)  # the commit may or may not have landed: start over
            raise
        recorder.landed(first, stop, ready_at)
        going = []
        for chunk, reply in zip(ready, replies):
            if isinstance(reply, KVFabricError):  # its lease expired on the target: gone
                log.info("push: %s refused %s of %s: %s", target, layers, chunk.key.hex(), reply)
            else:
                going.append(chunk)
        return going, stop

    def _abort(self, link: PeerLink, target: str, chunks: list[_Chunk], end: float) -> None:
        if not chunks or link.connection.closed:
            return  # a closed session has aborted its reservations already
        try:
            link.connection.call(
                Op.PEER_ABORT,
                {"leases": [c.lease for c in chunks]},
                timeout=max(end - time.monotonic(), 0) + ABORT_GRACE_S,
            )
        except KVFabricError as exc:
            # dropping the session aborts the reservations on the target's side
            log.info("aborting on %s failed (%s); dropping the connection", target, exc)
            self._links.forget(target)


def _reserve_item(key: bytes, reader: ObjectReader, fp8: bool) -> dict[str, Any]:
    """A ``peer_reserve`` item for a chunk pinned here: the target's copy keeps its tokens."""
    item: dict[str, Any] = {"key": key, "parent": reader.parent, "num_tokens": reader.num_tokens}
    if reader.tokens is not None:
        item["tokens"] = reader.tokens
    if fp8:
        item["wire"] = FP8
    return item


@dataclass
class _Moved:
    """Bytes a push moved, and what they are in the namespace's dtype."""

    wire: int = 0
    native: int = 0
