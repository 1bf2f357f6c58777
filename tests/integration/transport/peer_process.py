"""Helper peer for the transport fault tests (a separate process, so it can be killed).

``peer_process.py serve BACKEND NAME NBYTES``: owns region 0 holding ``(i % 251) + 1`` (never 0,
so a consumer sees the first byte land), prints ``DESCRIPTOR <hex>`` on one stdout line
(libraries may log to stdout too), then serves until stdin closes.

``peer_process.py consume BACKEND NAME NBYTES DESCRIPTOR_HEX``: connects to that owner, prints
``READING``, then reads its whole region 0 in 1 MiB pieces, over and over, until killed.
"""

from __future__ import annotations

import sys

import numpy as np

from kvfabric.transport import ReadPiece, select_backend

PIECE = 1 << 20


def serve(backend: str, name: str, nbytes: int) -> None:
    pattern = np.arange(1, 252, dtype=np.uint8)
    region = np.tile(pattern, nbytes // 251 + 1)[:nbytes].copy()
    transport = select_backend(backend)(name)
    transport.register(0, region)
    print("DESCRIPTOR", transport.descriptor().hex(), flush=True)
    sys.stdin.read()  # the transport's threads serve meanwhile
    transport.close()


def consume(backend: str, name: str, nbytes: int, descriptor: bytes) -> None:
    local = np.zeros(nbytes, np.uint8)
    transport = select_backend(backend)(name)
    transport.register(0, local)
    peer = transport.connect(descriptor, deadline=10.0)
    pieces = [ReadPiece(0, off, local[off : off + PIECE]) for off in range(0, nbytes, PIECE)]
    print("READING", flush=True)
    while True:
        transport.read(peer, pieces, deadline=60.0)


if __name__ == "__main__":
    mode, backend, name, nbytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if mode == "serve":
        serve(backend, name, nbytes)
    else:
        consume(backend, name, nbytes, bytes.fromhex(sys.argv[5]))
