"""The event path's costs for :mod:`kvfabric.planning.opcosts`: a node following the stream.

Who calls: :func:`kvfabric.planning.opcosts.measure_opcosts`, in its steps 5 and 6 (what a
follower does is listed there), once the chunks the follower reads are published.
:func:`follow`: a follower's cost to read a stretch of the stream and apply it;
:func:`inventory_bytes`: its memory per remote chunk; :func:`codec_costs`: the event codec
alone.

Units: the calling thread's CPU seconds (``time.thread_time``), per event or per apply as each
function says; bytes of Python heap (``tracemalloc``) per chunk; Redis figures as in
:mod:`kvfabric.planning.opcosts_counters`. Errors: the client's ``redis.exceptions.RedisError``
propagates (the caller turns it into :class:`~kvfabric.errors.UnavailableError`).
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

from kvfabric.cluster import events as codec
from kvfabric.cluster.index import ChunkRecord, KVEvent, Update
from kvfabric.kvevents.remote import RemoteInventory, RemoteUpdate
from kvfabric.kvevents.wire import encode_batch
from kvfabric.planning.opcosts_counters import PerOp, ServerCounters, per_op
from kvfabric.planning.opcosts_workload import TIER
from kvfabric.server.remote_chunks import IndexRemoteSource

BLOCK_SIZE = 16  # vLLM's default block size: what a follower names chunks as


class _Follow:
    """What a node's kv_events follower does with the index's stream (the daemon's
    :class:`RemoteFollower` loop, minus the thread): read from a position until caught up,
    then apply the updates and encode the vLLM events it announces."""

    def __init__(
        self, source: IndexRemoteSource, inventory: RemoteInventory, position: str
    ) -> None:
        self.source, self.inventory, self.position = source, inventory, position
        self.updates: list[RemoteUpdate] = []

    def part(self, events: int) -> Callable[[], int]:
        """Read until caught up, as a measured part of ``events`` operations (the stream
        entries after the position)."""

        def read() -> int:
            while True:
                got = self.source.read(self.position, 0)
                if not got.updates:
                    return events
                self.updates.extend(got.updates)
                self.position = got.position

        return read

    def apply(self) -> float:
        """The calling thread's CPU seconds to apply what was read and encode it."""
        start = time.thread_time()
        self.inventory.apply(self.updates)
        encode_batch(self.inventory.take() or [])
        return time.thread_time() - start


def follow(
    server: ServerCounters,
    source: IndexRemoteSource,
    start: str,
    events: int,
    known: list[RemoteUpdate],
    rounds: int = 3,
) -> tuple[PerOp, float, list[RemoteUpdate], str]:
    """Followers that already applied ``known`` read the ``events`` stream entries after
    ``start`` and apply them, ``rounds`` times afresh: the read's cost per event, the least
    CPU seconds of one apply, the updates read and the position reached."""
    followers = []
    for _ in range(rounds):
        inventory = RemoteInventory("opcosts-follower", BLOCK_SIZE, {TIER: "CPU"})
        inventory.apply(known)
        inventory.take()
        followers.append(_Follow(source, inventory, start))
    cost = per_op(server, [f.part(events) for f in followers])
    apply_cpu = min(f.apply() for f in followers)
    return cost, apply_cpu, followers[0].updates, followers[0].position


def inventory_bytes(updates: list[RemoteUpdate]) -> float:
    """Python heap a follower's RemoteInventory keeps per distinct remote chunk (token ids,
    block hashes, one claim per owner), after what it announced was taken."""
    chunks = len({(u.seed, u.key) for u in updates if u.stored})
    if not chunks:
        return 0.0
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        inventory = RemoteInventory("opcosts-follower", BLOCK_SIZE, {TIER: "CPU"})
        inventory.apply(updates)
        inventory.take()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()
    del inventory
    return kept / chunks


def codec_costs(
    chains: list[list[ChunkRecord]], run_chunks: int, writer_id: str
) -> tuple[float, float]:
    """Seconds per event of :func:`codec.encode` and :func:`codec.decode` (stored runs)."""
    events: list[KVEvent] = []
    for chain in chains:
        for i in range(0, len(chain), run_chunks):
            batch: list[Update] = [("stored", rec) for rec in chain[i : i + run_chunks]]
            events += codec.batch_events(batch, writer_id, 1)
    start = time.thread_time()
    encoded = [codec.encode(ev) for ev in events]
    encode_s = time.thread_time() - start
    start = time.thread_time()
    for i, fields in enumerate(encoded):
        codec.decode(f"1-{i}", fields)
    decode_s = time.thread_time() - start
    return encode_s / len(events), decode_s / len(events)
