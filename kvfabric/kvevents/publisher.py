"""The node's KV event stream: its whole inventory as vLLM KV events on a ZMQ PUB socket.

A router that does not sit next to an engine (vllm-router's ``kv_aware`` with
``--kv-event-source``, llm-d's indexer) subscribes here and learns what this node can serve,
in every tier, in the format vLLM engines publish (:mod:`kvfabric.kvevents.wire`).

Protocol, as vLLM's ``ZmqEventPublisher`` (so its subscribers work unchanged):

- PUB ``endpoint``: frames ``(topic, seq, payload)``; ``seq`` 8-byte big-endian, +1 per batch.
- ROUTER ``replay_endpoint`` (optional): a subscriber sends ``(b"", start_seq)`` (8 bytes
  big-endian) and gets every buffered batch with ``seq >= start_seq`` as
  ``(b"", topic, seq, payload)``, then ``(b"", b"", -1, b"")``.

Late subscribers: vllm-router (and vLLM's own example subscribers) ask for a replay from
the seq after the last one they saw, and must get every seq from there on, contiguous, or
they drop what they knew. A node's inventory outlives any buffer of batches, so the stream
**starts over** instead of dropping old batches: sequence 0 is always ``AllBlocksCleared``
and a snapshot of the whole announceable inventory (several batches if large), and the
replay buffer holds everything since. When the buffer would exceed ``buffer_batches`` or
``buffer_bytes`` (or the change log overflowed under this reader), the stream starts over
at seq 0 with a fresh snapshot; a subscriber sees the sequence go back, which vLLM's
subscribers read as a publisher restart (they forget this source and apply the new seq 0).
A router that starts at any time thus replays from 0 and learns the whole inventory.

With a :class:`~kvfabric.kvevents.remote.RemoteInventory` (``remote``) the stream also says
what other nodes of the cluster hold, with their ownership: its events after this node's own
changes, its claims in every snapshot after this node's inventory; when it piled up more
than it keeps for the stream, the stream starts over.

Bounded: at most ``max_events_per_batch`` events per batch, the buffer by count and bytes,
and ZMQ's send high-water mark drops batches for a subscriber that does not read.

Thread rules: one thread owns both sockets (ZMQ sockets are not thread-safe); :meth:`close`
stops it within a second. The store is only read through ``inventory`` (a snapshot).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import zmq

from kvfabric.kvevents.announce import Announcer
from kvfabric.kvevents.log import ChangeLog
from kvfabric.kvevents.remote import RemoteInventory
from kvfabric.kvevents.wire import Event, encode_batch, seq_bytes
from kvfabric.store.protocol import StoredObject

log = logging.getLogger(__name__)

END_SEQ = seq_bytes(-1)


class EventStream:
    """Publishes a :class:`ChangeLog` as vLLM KV event batches. Start with :meth:`start`."""

    def __init__(
        self,
        changes: ChangeLog,
        announcer: Announcer,
        inventory: Callable[[], Iterable[StoredObject]],
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        buffer_bytes: int = 256 << 20,
        max_events_per_batch: int = 1024,
        hwm: int = 100_000,
        remote: RemoteInventory | None = None,
    ) -> None:
        self._changes = changes
        self._remote = remote
        self._announcer = announcer
        self._inventory = inventory
        self._topic = topic.encode()
        self._max_events = max_events_per_batch
        self._buffer: list[tuple[int, bytes]] = []
        self._buffer_batches = buffer_batches
        self._buffer_bytes = buffer_bytes
        self._buffered_bytes = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"kv_events: cannot bind {endpoint} / {replay_endpoint}: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._position = changes.next_seq
        self._seq = -1  # the last batch published
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.batches_published = 0
        self.restarts = 0  # the stream started over at seq 0 with a snapshot

    def start(self) -> None:
        """Publish a first snapshot (subscribers already connected learn the inventory) and
        then follow the log."""
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._start_over()
            while not self._stop.is_set():
                self._serve_replays()
                read = self._changes.read(self._position, self._max_events, timeout=0.05)
                self._position = read.next_seq
                if read.gap:
                    log.warning("kv_events: the change log overflowed; starting over")
                    self._start_over()
                    continue
                events = self._announcer.events(read.changes)
                if self._remote is not None:
                    remote = self._remote.take()
                    if remote is None:
                        log.warning("kv_events: other nodes' chunks piled up; starting over")
                        self._start_over()
                        continue
                    events += remote
                self._publish(events)
        except Exception:
            log.exception("kv_events: the publisher thread failed; no more events are published")

    def _start_over(self) -> None:
        """Seq 0 again: ``AllBlocksCleared`` and the inventory. The log position is taken
        before the snapshot: the changes after it are published after the snapshot, and
        events are idempotent, so a subscriber converges to the store's state."""
        self._position = self._changes.next_seq
        self._seq = -1
        self._buffer.clear()
        self._buffered_bytes = 0
        self.restarts += 1
        events = self._announcer.snapshot(self._inventory())
        if self._remote is not None:
            events += self._remote.snapshot_events()
        self._publish(events, snapshot=True)

    def _publish(self, events: list[Event], *, snapshot: bool = False) -> None:
        step = self._max_events
        for i in range(0, len(events), step):
            payload = encode_batch(events[i : i + step])
            if not snapshot and (
                len(self._buffer) >= self._buffer_batches
                or self._buffered_bytes + len(payload) > self._buffer_bytes
            ):
                self._start_over()  # the snapshot holds what these events said
                return
            self._seq += 1
            self._pub.send_multipart((self._topic, seq_bytes(self._seq), payload))
            self._buffer.append((self._seq, payload))
            self._buffered_bytes += len(payload)
            self.batches_published += 1

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events: malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self._buffer[max(start_seq, 0) :]:
                self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
