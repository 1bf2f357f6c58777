"""A batch put whose round trips overlap its copies (:meth:`kvfabric.client.Client.put_many`).

A put of many chunks is reserve, copy, commit. Done as two batch requests around the copies,
the daemon's work on every item (allocating pages, leases, announcing the chunk) adds to the
copy time: about 50 µs a chunk, a third of a 4 MiB copy. Pipelined, the daemon reserves the
next group of chunks and commits the previous one while the client copies the current one
(the daemon has a core of its own), so what is left exposed is the first group's reservation
and the last commit:

* groups grow fourfold (:func:`groups`): the first is small, so the first copy starts early;
  each next one is reserved while the client copies the one before;
* each group is committed in two halves, the second half's commit being the only one the
  caller waits for at the end;
* a batch under :data:`PIPELINE_MIN_BYTES` is one group: for small payloads the extra round
  trips would cost more than the copies they overlap.

Errors are those of a plain batch put: an item the node already holds counts as not stored
(``False``); any other item's error is raised after every reservation made is aborted,
those of a group still in flight included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvfabric.client import requests
from kvfabric.client.connection import Connection, PendingReply
from kvfabric.client.objects import RemoteWriter
from kvfabric.errors import AlreadyExistsError, KVFabricError
from kvfabric.hashing import ChunkRef, ChunkTokens
from kvfabric.protocol.messages import Op
from kvfabric.spec import Namespace

# Below this many payload bytes in all, a put is not worth splitting: one reserve, one commit.
PIPELINE_MIN_BYTES = 8 << 20
GROWTH = 4


def groups(count: int, first: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``count`` items: ``first`` items, then ``GROWTH`` times
    as many as the group before."""
    lo, size = 0, max(1, first)
    while lo < count:
        hi = min(count, lo + size)
        yield lo, hi
        lo, size = hi, size * GROWTH


def put_many(
    session: Connection,
    ns: Namespace,
    chunks: Sequence[ChunkRef],
    payloads: Sequence[Any],
    tokens: Sequence[ChunkTokens | None] | None,
) -> list[bool]:
    """Store ``chunks`` (see the module docstring); ``True`` where this call stored it."""
    per_chunk = [None] * len(chunks) if tokens is None else list(tokens)
    # chunk_bytes: a full chunk's payload (a chain's last chunk may be shorter)
    big = ns.spec.chunk_bytes * len(chunks) >= PIPELINE_MIN_BYTES
    first = len(chunks) // 8 if big else len(chunks)
    spans = list(groups(len(chunks), first))
    stored: list[bool] = []
    reserved: list[RemoteWriter] = []
    commits: list[PendingReply] = []

    def reserve(span: tuple[int, int]) -> PendingReply:
        lo, hi = span
        args = requests.reserve_batch_args(ns, chunks[lo:hi], None, per_chunk[lo:hi])
        return session.send(Op.RESERVE_BATCH, args)

    in_flight: PendingReply | None = reserve(spans[0])
    try:
        for index, (lo, hi) in enumerate(spans):
            assert in_flight is not None
            results = requests.item_results(in_flight.result())
            in_flight = None
            writers = [
                r if isinstance(r, KVFabricError) else RemoteWriter(session, ns, c.key, r)
                for c, r in zip(chunks[lo:hi], results)
            ]
            reserved += [w for w in writers if isinstance(w, RemoteWriter)]
            requests.raise_first(
                [w for w in writers if not isinstance(w, (RemoteWriter, AlreadyExistsError))]
            )
            if index + 1 < len(spans):
                in_flight = reserve(spans[index + 1])
            todo = [(w, p) for w, p in zip(writers, payloads[lo:hi]) if isinstance(w, RemoteWriter)]
            half = (len(todo) + 1) // 2
            for part in (todo[:half], todo[half:]):
                for writer, payload in part:
                    writer.write(payload)
                if part:
                    commits.append(
                        session.send(Op.COMMIT_BATCH, requests.leases_args([w for w, _ in part]))
                    )
            stored += [isinstance(w, RemoteWriter) for w in writers]
    except BaseException:
        _abort(session, reserved, in_flight)
        raise
    for pending in commits:
        requests.raise_first(requests.item_results(pending.result()))
    return stored


def _abort(
    session: Connection, reserved: list[RemoteWriter], in_flight: PendingReply | None
) -> None:
    """Abort every reservation not committed yet, the group still in flight included."""
    leases = [w.lease for w in reserved if not w.closed]
    for writer in reserved:
        writer.closed = True
    try:
        if in_flight is not None:
            late = requests.item_results(in_flight.result())
            leases += [int(r["lease"]) for r in late if not isinstance(r, KVFabricError)]
        for lease in leases:
            session.call(Op.ABORT, {"lease": lease})
    except KVFabricError:
        pass  # the session is gone: the daemon aborted its reservations with it
