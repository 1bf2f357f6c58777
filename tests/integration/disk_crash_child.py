"""Child process of test_disk_crash.py: writes to a DiskTier until it is SIGKILLed.

Usage: ``python disk_crash_child.py DIRECTORY SEED``

It reopens and scans the directory (so restarts over torn tails are exercised), then writes
random-sized objects whose payload is derived from the key, deletes some and compacts now
and then. Each event is one flushed stdout line, printed only once the tier call is done:

    READY <records recovered>
    W <key hex>      the write future completed: the record must survive a SIGKILL
    d <key hex>      about to delete: after a kill the key may or may not be present
    D <key hex>      the delete returned: the key must never be served again
    IDLE             the write budget is spent; waiting to be killed
"""

from __future__ import annotations

import functools
import itertools
import random
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future

from kvfabric.tiers.disk import DiskExtent, DiskTier

MAX_WRITES = 1500
LIVE_CAP = 300  # keeps the directory (and the parent's checks) small across rounds
WINDOW = 4  # writes in flight, so some are always torn by the kill


def open_tier(directory: str) -> DiskTier:
    """The tier configuration shared by the child and the parent's checks."""
    return DiskTier(directory, capacity_bytes=1 << 30, segment_bytes=1 << 20, writers=2)


def payload_len(key: bytes) -> int:
    r = int.from_bytes(key[:4], "little")
    if r % 32 == 0:  # a few large records, so kills land mid-write and leave torn tails
        return r % (4 << 20)
    return r % (256 << 10) if r % 16 == 1 else r % (32 << 10)


def payload_for(key: bytes) -> bytes:
    return random.Random(key).randbytes(payload_len(key))


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(directory: str, seed: int) -> None:
    tier = open_tier(directory)
    owner = {r.key: r.extent for r in tier.scan()}  # acknowledged (main thread only)
    landed: dict[bytes, DiskExtent] = {}  # written, not acknowledged yet (done callbacks)
    lock = threading.Lock()
    emit(f"READY {len(owner)}")
    rng = random.Random(seed)

    def learn(key: bytes, future: Future[DiskExtent]) -> None:
        # as the store does: the extent is learnt in the done callback, so compaction may
        # move the record before the main thread acknowledges it
        with lock:
            if key not in owner:  # result() may return in the main thread before this runs
                landed[key] = future.result()

    def relocate(key: bytes, old: DiskExtent, new: DiskExtent) -> bool:
        with lock:
            known = owner if key in owner else landed
            if known.get(key) != old:
                return False
            known[key] = new
            return True

    def acknowledge(key: bytes, future: Future[DiskExtent]) -> None:
        extent = future.result()
        with lock:
            owner[key] = landed.pop(key, extent)
        emit(f"W {key.hex()}")

    inflight: deque[tuple[bytes, Future[DiskExtent]]] = deque()
    for n in range(MAX_WRITES):
        key = rng.randbytes(16)
        data = memoryview(payload_for(key))
        cut = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(3)))
        pieces = [data[a:b] for a, b in itertools.pairwise([0, *cut, len(data)])]
        future = tier.write(key, b"crash-test", pieces)
        future.add_done_callback(functools.partial(learn, key))
        inflight.append((key, future))
        while inflight and (len(inflight) > WINDOW or inflight[0][1].done()):
            acknowledge(*inflight.popleft())
        if len(owner) > LIVE_CAP:
            victim = rng.choice(list(owner))
            emit(f"d {victim.hex()}")
            with lock:
                extent = owner.pop(victim)
            tier.delete(extent)
            emit(f"D {victim.hex()}")
        if n % 100 == 99:
            tier.compact(relocate, min_dead_ratio=0.3)
    while inflight:
        acknowledge(*inflight.popleft())
    emit("IDLE")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
