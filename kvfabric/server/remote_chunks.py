"""The global index as the source of other nodes' chunks for the node's KV event stream.

:class:`IndexRemoteSource` is the :class:`~kvfabric.kvevents.remote.RemoteSource` the daemon
gives :class:`~kvfabric.kvevents.remote.RemoteFollower` (KV events do not import the cluster
plane; the translation lives here):

- :meth:`~IndexRemoteSource.resync`: the index's snapshot (every live copy, consistent with
  a stream id) and the live nodes. A snapshot has no token ids (the index's entries never
  hold them), so they are looked up in the event stream's stored entries up to the
  snapshot's id: a chunk whose stored entry the stream no longer holds
  (trimmed to ``max_events``) has none, and is not announced until it is stored again. This
  reads the whole retained stream once per resync.
- :meth:`~IndexRemoteSource.read`: the stream's events after a position, one update per chunk;
  ``gap`` when the stream was trimmed past the position
  (:meth:`~kvfabric.cluster.index.GlobalIndex.first_event_id`).
- :meth:`~IndexRemoteSource.live`: the live nodes' epochs.

Every method raises :class:`~kvfabric.errors.UnavailableError` while the index is unreachable
(the follower retries and resyncs); a malformed stream entry raises
:class:`~kvfabric.errors.ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from kvfabric.cluster.index import GlobalIndex, KVEvent, parse_stream_id
from kvfabric.kvevents.remote import RemoteRead, RemoteUpdate, RemoteView

ChunkTokens = tuple[bytes, int, str]  # token ids, chunk_tokens, lora_id


class IndexRemoteSource:
    """Other nodes' chunks as :mod:`kvfabric.kvevents.remote` reads them; see the module."""

    def __init__(self, index: GlobalIndex, *, page: int = 1000) -> None:
        self._index = index
        self._page = page

    def resync(self) -> RemoteView:
        snap = self._index.snapshot()
        live = self.live()
        wanted = {(bytes.fromhex(ev.seed_hex), key) for ev in snap.events for key in ev.keys}
        tokens = self._stored_tokens(wanted, snap.stream_id)
        chunks: list[RemoteUpdate] = []
        for ev in snap.events:
            seed = bytes.fromhex(ev.seed_hex)
            for copy in updates(ev):
                found = tokens.get((seed, copy.key))
                chunks.append(
                    copy
                    if found is None
                    else replace(copy, tokens=found[0], chunk_tokens=found[1], lora_id=found[2])
                )
        return RemoteView(snap.stream_id, chunks, live)

    def _stored_tokens(
        self, wanted: set[tuple[bytes, bytes]], until: str
    ) -> dict[tuple[bytes, bytes], ChunkTokens]:
        """The token ids of the ``wanted`` chunks that stored entries up to ``until`` carry."""
        found: dict[tuple[bytes, bytes], ChunkTokens] = {}
        if not wanted or until == "0-0":
            return found
        end = parse_stream_id(until)
        position = "0-0"
        while True:
            page = self._index.events(position, count=self._page)
            for ev in page:
                if parse_stream_id(ev.stream_id) > end:
                    return found
                if ev.token_ids is None:
                    continue
                seed = bytes.fromhex(ev.seed_hex)
                for key, ids in zip(ev.keys, ev.token_ids, strict=True):
                    if (seed, key) in wanted:
                        found[(seed, key)] = (ids, ev.chunk_tokens, ev.lora_id)
            if len(page) < self._page:
                return found
            position = page[-1].stream_id

    def read(self, after: str, block_ms: int) -> RemoteRead:
        events = self._index.events(after, block_ms=block_ms, count=self._page)
        if not events:
            return RemoteRead([], after, False)
        if after != "0-0" and parse_stream_id(self._index.first_event_id()) > parse_stream_id(
            after
        ):
            return RemoteRead([], after, True)
        return RemoteRead([u for ev in events for u in updates(ev)], events[-1].stream_id, False)

    def live(self) -> Mapping[str, int]:
        return {node.node_id: node.epoch for node in self._index.nodes()}


def updates(event: KVEvent) -> list[RemoteUpdate]:
    """One update per chunk of an index event (a stored run is a chain: each chunk the
    parent of the next, the first one's parent the event's)."""
    seed = bytes.fromhex(event.seed_hex)
    stored = event.kind == "stored"
    out = []
    for i, key in enumerate(event.keys):
        out.append(
            RemoteUpdate(
                stored,
                event.node_id,
                event.epoch,
                event.tier,
                seed,
                key,
                event.parent if i == 0 else event.keys[i - 1],
                None if event.token_ids is None else event.token_ids[i],
                event.chunk_tokens,
                event.lora_id,
            )
        )
    return out
