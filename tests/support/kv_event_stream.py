"""A consumer of vLLM KV event streams that reads them as vllm-router 0.1.17's ``kv_aware``
subscriber does (/work/helpers/router-research.md, section 2), decoding with vLLM's own types.

`EventFollower` connects a SUB socket to a publisher (a kvfabric daemon's ``kv_events``
stream, or a vLLM engine's ``--kv-events-config`` publisher) and follows its sequence:
frames must be ``(topic, seq 8-byte big-endian, payload)``; a seq beyond the next one
(the slow-joiner start included) is a gap, filled from the replay endpoint when there is
one; a seq that goes back is a publisher that started over (the router forgets the
source). Every payload is decoded by ``msgspec.msgpack.Decoder(KVEventBatch)``: a batch
that vLLM's decoder refuses fails the test. `BlockState` applies the events as a set of
(hash, medium) residencies, and blocks stored with an ``ownership`` (a shared pool's, which
vllm-router credits as external) as (hash, medium, ownership) claims apart, removed only by
a removal with the same ownership and medium and not by ``AllBlocksCleared``: what a router
ends up believing.

`replay` is one replay request exactly as the router sends it: a DEALER, ``[b"", start]``,
answered ``[b"", topic, seq, payload]`` per batch and ``[b"", b"", -1, b""]`` at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

DECODE = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = -1


def seq_of(frame: bytes) -> int:
    assert len(frame) == 8, f"a seq frame of {len(frame)} bytes"
    return int.from_bytes(frame, "big", signed=True)


def replay(endpoint: str, start: int, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """Every batch the publisher's replay socket answers from ``start`` on, checked to be
    contiguous and ended by the end marker."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[tuple[int, KVEventBatch]] = []
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + timeout_s
        while True:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), (
                f"no end marker from {endpoint} within {timeout_s}s ({len(out)} batches)"
            )
            frames = sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            _, topic, seq_frame, payload = frames
            seq = seq_of(seq_frame)
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return out
            assert topic == b"", topic  # vllm-router's static sources use the topic ""
            assert seq == (out[-1][0] + 1 if out else start), (seq, start, len(out))
            out.append((seq, DECODE.decode(payload)))
    finally:
        sock.close(linger=0)


@dataclass
class BlockState:
    """What a consumer believes after applying events: (hash, medium) residencies, and the
    token ids and parent each hash was stored with."""

    held: set[tuple[int | bytes, str | None]] = field(default_factory=set)
    tokens: dict[int | bytes, list[int]] = field(default_factory=dict)
    parent: dict[int | bytes, int | bytes | None] = field(default_factory=dict)
    owned: set[tuple[int | bytes, str | None, str]] = field(default_factory=set)
    clears: int = 0

    def apply(self, event: KVCacheEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.held.clear()  # the worker's own blocks only: pool claims stay
            self.clears += 1
        elif isinstance(event, BlockStored):
            size = event.block_size
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                if event.ownership:
                    self.owned.add((block, event.medium, event.ownership))
                else:
                    self.held.add((block, event.medium))
                self.tokens[block] = list(event.token_ids[i * size : (i + 1) * size])
                self.parent[block] = parent
                parent = block
        elif isinstance(event, BlockRemoved):
            for block in event.block_hashes:
                if event.ownership:
                    self.owned.discard((block, event.medium, event.ownership))
                else:
                    self.held.discard((block, event.medium))

    def media(self, block: int | bytes) -> set[str | None]:
        return {medium for h, medium in self.held if h == block}


class EventFollower:
    """Follows one publisher's stream as the router does; :meth:`pump` reads what arrived."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None) -> None:
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.last_seq = -1
        self.state = BlockState()
        self.events: list[KVCacheEvent] = []  # every event applied, in order
        self.live = 0  # batches applied from the PUB socket
        self.replayed = 0  # batches applied from replays
        self.restarts = 0  # the sequence went back: the publisher started over

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> EventFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.state.apply(event)
            self.events.append(event)

    def pump(self, wait_s: float = 0.0) -> int:
        """Apply every batch that arrived (waiting up to ``wait_s`` for the first); returns
        how many live batches were read."""
        read = 0
        timeout_ms = int(wait_s * 1000)
        while self._sub.poll(timeout_ms):
            timeout_ms = 0
            frames = self._sub.recv_multipart()
            assert len(frames) == 3, f"{len(frames)} frames"
            topic, seq_frame, payload = frames
            assert topic == b"", topic
            seq = seq_of(seq_frame)
            read += 1
            if seq == self.last_seq:
                continue  # a duplicate
            if seq < self.last_seq:
                self.restarts += 1  # started over: forget the source, apply the new seq
                self.state = BlockState()
                self.last_seq = -1
            if seq > self.last_seq + 1 and self._replay_endpoint is not None:
                for replayed_seq, batch in replay(self._replay_endpoint, self.last_seq + 1):
                    if replayed_seq <= seq:
                        self._apply(batch)
                        self.replayed += 1
                        self.last_seq = replayed_seq
                assert self.last_seq == seq, (self.last_seq, seq)  # replay covered the live one
                continue
            self._apply(DECODE.decode(payload))
            self.live += 1
            self.last_seq = seq
        return read

    def wait_until(self, done: Callable[[BlockState], bool], timeout_s: float) -> BlockState:
        """Pump until ``done(state)``; fails after ``timeout_s`` with what was seen."""
        deadline = time.monotonic() + timeout_s
        while not done(self.state):
            assert time.monotonic() < deadline, (
                f"not seen in {timeout_s}s; {len(self.events)} events, last seq "
                f"{self.last_seq}, state {sorted(map(str, self.state.held))[:20]}"
            )
            self.pump(0.1)
        return self.state
