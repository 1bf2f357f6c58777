"""Chunks other nodes of the cluster hold, as this node's vLLM KV events: "pullable from there".

A node of a cluster can pull any chunk another live node holds (:mod:`kvfabric.server.puller`),
so an engine behind this node can be credited for it, at a lower rate than for what is here.
vLLM's vocabulary has a word for it: a block with an ``ownership`` is held by a shared pool,
and a router that consumes the events (vllm-router's ``kv_aware``) credits it as "external"
for the worker whose stream reported it (``--kv-penalty-external``). :class:`RemoteInventory`
keeps what the global index says other nodes hold and says it as:

- ``BlockStored`` with ``ownership`` = ``kvfabric:<owner node id>``, ``locality`` ``REMOTE``,
  the medium of the owner's tier (by its name, the medium of this node's tier of that name:
  nodes of a cluster share tier names; ``CPU`` for a name this node lacks), and the token ids
  the owner published with the chunk;
- ``BlockRemoved`` with the same ownership, locality and medium when the owner's last copy in
  tiers of that medium goes (consumers key such claims by ownership and medium), when its
  lease lapses (:meth:`RemoteInventory.expire`) or when a newer epoch of it appears (a
  restart: it publishes its inventory again).

Nothing of this node itself is announced here (its own stream names its own inventory,
without ownership). A copy whose owner published no token ids cannot be announced (consumers
hash token ids) and is counted in ``unannounced``; nor is one of a namespace whose chunks do
not split into whole blocks.

This package does not read the global index (the import contract: KV events stand on the
store, nothing above it): the daemon translates the index into :class:`RemoteUpdate` values
behind a :class:`RemoteSource`, and :class:`RemoteFollower` is the thread that reads it: a
full view (:meth:`RemoteSource.resync`) at start, after a gap in the index's event stream and
after an outage, then the stream's updates, and the live nodes every ``live_every_s``.
vLLM's ``AllBlocksCleared`` does not clear ownership claims, so a resync says the difference
from what was said before, claim by claim.

The node's :class:`~kvfabric.kvevents.publisher.EventStream` takes the events
(:meth:`RemoteInventory.take`) and, when it starts over, every current claim again
(:meth:`RemoteInventory.snapshot_events`). For that the inventory keeps every announced
chunk's token ids: 4 bytes per token per chunk (once, whatever the number of its owners).

Thread-safe: one lock; the follower writes, the stream reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvfabric.errors import KVFabricError
from kvfabric.hashing import ROOT
from kvfabric.kvevents.blocks import engine_blocks
from kvfabric.kvevents.wire import Event, block_removed, block_stored

log = logging.getLogger(__name__)

OWNERSHIP_PREFIX = "kvfabric:"
LOCALITY = "REMOTE"
UNKNOWN_TIER_MEDIUM = "CPU"


@dataclass(frozen=True)
class RemoteUpdate:
    """One chunk another node (``node_id``, incarnation ``epoch``) stored in (``stored``) or
    removed from its ``tier``. Stored copies carry the chunk's ``parent`` and, when its owner
    published them, its own token ids (``tokens``, int32-LE) with the namespace's
    ``chunk_tokens`` and ``lora_id``."""

    stored: bool
    node_id: str
    epoch: int
    tier: str
    seed: bytes
    key: bytes
    parent: bytes = ROOT
    tokens: bytes | None = None
    chunk_tokens: int = 0
    lora_id: str = ""


@dataclass(frozen=True)
class RemoteView:
    """Everything live nodes hold (stored updates) and the live nodes' epochs, consistent
    with the stream ``position``: the updates after it follow."""

    position: str
    chunks: list[RemoteUpdate]
    live: Mapping[str, int]


@dataclass(frozen=True)
class RemoteRead:
    """Updates after a position, the new ``position``, and ``gap``: some were lost."""

    updates: list[RemoteUpdate]
    position: str
    gap: bool


class RemoteSource(Protocol):
    """The global index as this module reads it; every method may raise
    :class:`~kvfabric.errors.KVFabricError` (the index is unavailable)."""

    def resync(self) -> RemoteView: ...

    def read(self, after: str, block_ms: int) -> RemoteRead: ...

    def live(self) -> Mapping[str, int]: ...


@dataclass
class _Chunk:
    """What saying a chunk again needs; ``claims`` counts the claims that name it."""

    parent: bytes
    tokens: bytes
    chunk_tokens: int
    lora_id: str
    hashes: tuple[int, ...]
    claims: int = 0


@dataclass
class _Claim:
    """One owner's copies of a chunk in tiers of one medium (one claim for consumers)."""

    tiers: set[str] = field(default_factory=set)


ClaimKey = tuple[bytes, bytes, str]  # (seed, key, medium)


class RemoteInventory:
    """Other nodes' chunks as events with ownership; see the module docstring."""

    def __init__(
        self,
        node_id: str,
        block_size: int,
        medium_of_tier: Mapping[str, str],
        *,
        max_pending: int = 1 << 16,
    ) -> None:
        self.node_id = node_id
        self.block_size = block_size
        self._medium = dict(medium_of_tier)
        self._max_pending = max_pending
        self._lock = threading.Lock()
        # node -> the epoch whose updates apply; older ones are ignored, a newer one
        # replaces the node's claims
        self._epochs: dict[str, int] = {}
        # node -> its epoch whose lease lapsed: updates of it (or older) are ignored
        self._lapsed: dict[str, int] = {}
        self._claims: dict[str, dict[ClaimKey, _Claim]] = {}
        self._chunks: dict[tuple[bytes, bytes], _Chunk] = {}
        self._pending: list[Event] = []
        self._overflow = False
        self.unannounced = 0  # stored copies without token ids

    # -- what the stream reads -----------------------------------------------------------

    def take(self) -> list[Event] | None:
        """The events since the last call; None when more than ``max_pending`` piled up (the
        reader fell behind: it starts over with :meth:`snapshot_events`)."""
        with self._lock:
            if self._overflow:
                return None
            out, self._pending = self._pending, []
            return out

    def snapshot_events(self) -> list[Event]:
        """Every current claim as ``BlockStored``, parents first; what :meth:`take` had not
        returned yet is in it, so it is dropped."""
        with self._lock:
            self._pending = []
            self._overflow = False
            return self._say_stored(lambda node, claim_key: True)

    @property
    def claims(self) -> int:
        """How many (owner, chunk, medium) claims are announced now."""
        with self._lock:
            return sum(len(c) for c in self._claims.values())

    # -- what the follower writes --------------------------------------------------------

    def apply(self, updates: Iterable[RemoteUpdate]) -> None:
        """Updates of the index's event stream, in order."""
        with self._lock:
            for update in updates:
                if update.node_id == self.node_id or not self._admit(update.node_id, update.epoch):
                    continue
                if update.stored:
                    self._add(update)
                else:
                    self._remove(update.node_id, update.tier, update.seed, update.key)
            self._check_pending()

    def expire(self, live: Mapping[str, int]) -> None:
        """``live``: every live node's epoch. The claims of a node not in it, or live under a
        newer epoch, are removed; later updates of the lapsed epoch are ignored."""
        with self._lock:
            for node, epoch in list(self._epochs.items()):
                now = live.get(node)
                if now is None or now > epoch:
                    self._drop_node(node)
                    if now is None:
                        del self._epochs[node]
                        self._lapsed[node] = epoch
                    else:
                        self._epochs[node] = now
            self._check_pending()

    def resync(self, chunks: Iterable[RemoteUpdate], live: Mapping[str, int]) -> None:
        """Replace the state with a full view (``chunks``: stored copies of live nodes) and
        say the difference. Copies without token ids keep those said before, if any."""
        with self._lock:
            old_claims, old_chunks = self._claims, self._chunks
            self._claims, self._chunks = {}, {}
            self._lapsed = {
                n: e for n, e in (*self._lapsed.items(), *self._epochs.items()) if n not in live
            }
            self._epochs = {n: e for n, e in live.items() if n != self.node_id}
            for update in chunks:
                if update.node_id == self.node_id or update.epoch != self._epochs.get(
                    update.node_id
                ):
                    continue
                chunk_id = (update.seed, update.key)
                known = old_chunks.get(chunk_id)
                if update.tokens is None and known is not None and chunk_id not in self._chunks:
                    self._chunks[chunk_id] = replace(known, claims=0)
                self._add(update, say=False)
            # the difference: removals of what is gone, then what is new, parents first
            for node, claims in old_claims.items():
                for claim_key in claims:
                    if claim_key not in self._claims.get(node, {}):
                        chunk = old_chunks[claim_key[:2]]
                        self._pending.append(self._removed(node, chunk, claim_key[2]))
            self._pending += self._say_stored(
                lambda node, claim_key: claim_key not in old_claims.get(node, {})
            )
            self._check_pending()

    # -- under the lock --------------------------------------------------------------------

    def _admit(self, node: str, epoch: int) -> bool:
        if epoch <= self._lapsed.get(node, -1):
            return False
        self._lapsed.pop(node, None)
        current = self._epochs.get(node)
        if current is not None and epoch < current:
            return False
        if current is None or epoch > current:
            self._drop_node(node)  # a restart: it publishes its inventory again
            self._epochs[node] = epoch
        return True

    def _add(self, update: RemoteUpdate, *, say: bool = True) -> None:
        medium = self._medium.get(update.tier, UNKNOWN_TIER_MEDIUM)
        claims = self._claims.setdefault(update.node_id, {})
        claim_key = (update.seed, update.key, medium)
        claim = claims.get(claim_key)
        if claim is not None:
            claim.tiers.add(update.tier)
            return
        chunk = self._chunks.get(claim_key[:2])
        if chunk is None:
            chunk = self._chunk(update)
            if chunk is None:
                if not claims:
                    del self._claims[update.node_id]
                return
            self._chunks[claim_key[:2]] = chunk
        chunk.claims += 1
        claims[claim_key] = _Claim({update.tier})
        if say:
            self._pending.append(self._stored(update.node_id, update.seed, update.key, medium))

    def _chunk(self, update: RemoteUpdate) -> _Chunk | None:
        if update.tokens is None:
            self.unannounced += 1
            return None
        if update.chunk_tokens % self.block_size:
            return None  # no whole blocks to name, as for this node's own chunks
        blocks = engine_blocks(
            update.key, update.parent, update.tokens, update.chunk_tokens, self.block_size
        )
        if blocks is None:
            return None
        return _Chunk(
            update.parent, update.tokens, update.chunk_tokens, update.lora_id, blocks.hashes
        )

    def _remove(self, node: str, tier: str, seed: bytes, key: bytes) -> None:
        medium = self._medium.get(tier, UNKNOWN_TIER_MEDIUM)
        claims = self._claims.get(node, {})
        claim = claims.get((seed, key, medium))
        if claim is None or tier not in claim.tiers:
            return
        claim.tiers.discard(tier)
        if not claim.tiers:
            self._pending.append(self._release(node, (seed, key, medium)))

    def _drop_node(self, node: str) -> None:
        for claim_key in list(self._claims.get(node, ())):
            self._pending.append(self._release(node, claim_key))

    def _release(self, node: str, claim_key: ClaimKey) -> Event:
        """Forget one claim; its removal event."""
        claims = self._claims[node]
        del claims[claim_key]
        if not claims:
            del self._claims[node]
        chunk = self._chunks[claim_key[:2]]
        chunk.claims -= 1
        if not chunk.claims:
            del self._chunks[claim_key[:2]]
        return self._removed(node, chunk, claim_key[2])

    def _stored(self, node: str, seed: bytes, key: bytes, medium: str) -> Event:
        chunk = self._chunks[(seed, key)]
        blocks = engine_blocks(key, chunk.parent, chunk.tokens, chunk.chunk_tokens, self.block_size)
        assert blocks is not None  # checked when the chunk was kept
        return block_stored(
            blocks,
            medium,
            chunk.lora_id or None,
            locality=LOCALITY,
            ownership=OWNERSHIP_PREFIX + node,
        )

    @staticmethod
    def _removed(node: str, chunk: _Chunk, medium: str) -> Event:
        return block_removed(
            list(chunk.hashes), medium, locality=LOCALITY, ownership=OWNERSHIP_PREFIX + node
        )

    def _say_stored(self, which: Callable[[str, ClaimKey], bool]) -> list[Event]:
        """``BlockStored`` of the claims ``which`` picks, parents first."""
        holders: dict[tuple[bytes, bytes], list[tuple[str, ClaimKey]]] = {}
        for node, claims in self._claims.items():
            for claim_key in claims:
                if which(node, claim_key):
                    holders.setdefault(claim_key[:2], []).append((node, claim_key))
        return [
            self._stored(node, *claim_key)
            for chunk_id in self._chain_order(self._chunks)
            for node, claim_key in holders.get(chunk_id, ())
        ]

    def _check_pending(self) -> None:
        if len(self._pending) > self._max_pending:
            self._pending = []
            self._overflow = True

    @staticmethod
    def _chain_order(chunks: Mapping[tuple[bytes, bytes], _Chunk]) -> list[tuple[bytes, bytes]]:
        """The chunks with every one after its parent (consumers drop a stored block whose
        parent they have not seen)."""
        children: dict[tuple[bytes, bytes], list[tuple[bytes, bytes]]] = {}
        roots: list[tuple[bytes, bytes]] = []
        for (seed, key), chunk in chunks.items():
            parent = (seed, chunk.parent)
            if parent in chunks and chunk.parent != key:
                children.setdefault(parent, []).append((seed, key))
            else:
                roots.append((seed, key))
        out: list[tuple[bytes, bytes]] = []
        stack = list(reversed(roots))
        while stack:
            item = stack.pop()
            out.append(item)
            stack += reversed(children.get(item, ()))
        return out


class RemoteFollower:
    """The thread that keeps a :class:`RemoteInventory` up to date from a
    :class:`RemoteSource`. Start with :meth:`start`; :meth:`close` stops it within
    ``block_ms``."""

    def __init__(
        self,
        source: RemoteSource,
        inventory: RemoteInventory,
        *,
        block_ms: int = 500,
        live_every_s: float = 1.0,
        retry_s: float = 1.0,
    ) -> None:
        self._source = source
        self._inventory = inventory
        self._block_ms = block_ms
        self._live_every_s = live_every_s
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-remote", daemon=True)
        self.resyncs = 0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._block_ms / 1000 + 5)

    def _run(self) -> None:
        position: str | None = None
        next_live = 0.0
        failing = False
        while not self._stop.is_set():
            try:
                if position is None:
                    view = self._source.resync()
                    self._inventory.resync(view.chunks, view.live)
                    self.resyncs += 1
                    position = view.position
                    next_live = time.monotonic() + self._live_every_s
                read = self._source.read(position, self._block_ms)
                if read.gap:
                    log.warning("kv_events: the index's event stream lost events; resyncing")
                    position = None
                    continue
                self._inventory.apply(read.updates)
                position = read.position
                if time.monotonic() >= next_live:
                    self._inventory.expire(self._source.live())
                    next_live = time.monotonic() + self._live_every_s
                failing = False
            except Exception as exc:  # the thread must outlive an outage or a bad entry
                if not failing:
                    failing = True
                    if isinstance(exc, KVFabricError):
                        log.warning("kv_events: other nodes' chunks not followed: %s", exc)
                    else:
                        log.exception("kv_events: following other nodes' chunks failed")
                position = None  # the index may have lost its stream: start from a full view
                self._stop.wait(self._retry_s)
