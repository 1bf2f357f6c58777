"""What the chaos harness's processes agree on: tenants, namespaces, the payload every chunk
carries, and the JSON-lines event files they report through.

**Payloads check themselves end to end.** A chunk's bytes are a function of its key alone
(:func:`payload`): its tenant's 8-byte marker, the key, then bytes from a generator seeded by
the key. Any process that reads a chunk recomputes them and compares every byte
(:func:`verify`), so a wrong page, a torn write, another tenant's bytes or a frozen writer's
late bytes are all caught, whichever path served the chunk. The marker at the start of a
chunk's first page also lets a process find a tenant's chunks in whatever arena memory it has
mapped (the cross-tenant memory scan).

**Audit keys.** Acknowledged chunks whose key's last byte is even are *audit keys*: readers
never read them (a read promotes an SSD chunk to DRAM), so once the auditor has seen one on
the SSD tier, only a counted eviction or its writer's delete may make it go.

**Event files.** Each worker appends one JSON object per line to its own file and flushes
it: ``ack`` / ``del`` (writers: ``del`` is written *before* the delete is sent, so nobody
mistakes a deleted chunk for a lost one), ``err`` (kind of a typed client error), ``corrupt``,
``cross`` (a cross-tenant read), ``counts`` (cumulative counters; the last one wins), ``done``.
:class:`Tail` reads such a file incrementally while it grows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvfabric.spec import KVSpec, Namespace

ADMIN_TOKEN = "chaos-admin-3f9c1a"
TENANTS = ("a", "b")
TOKENS = {"a": "chaos-tok-a-51e2", "b": "chaos-tok-b-98d0"}
SALTS = {"a": "team-a", "b": "team-b"}
# 16 KiB chunks: 4 layers x K/V x 2 heads x 16 tokens x 32 dims x bf16
SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
CHUNK = SPEC.chunk_bytes
MODEL = "chaos-model"
MARKER_LEN = 8
FROZEN_FILL = b"FROZEN!!"  # what a frozen writer writes once it wakes up


def namespace(tenant: str) -> Namespace:
    return Namespace(MODEL, SPEC, tenant_salt=SALTS[tenant])


def marker(tenant: str) -> bytes:
    return b"KVCHAOS" + tenant.encode()


def payload(tenant: str, key: bytes) -> np.ndarray:
    """The only bytes chunk ``key`` of ``tenant`` may ever hold."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    data = np.frombuffer(rng.bytes(CHUNK), dtype=np.uint8).copy()
    data[:MARKER_LEN] = np.frombuffer(marker(tenant), dtype=np.uint8)
    data[MARKER_LEN : MARKER_LEN + 16] = np.frombuffer(key, dtype=np.uint8)
    return data


def verify(tenant: str, key: bytes, data: bytes) -> str:
    """``ok``, or how the bytes are wrong: ``frozen`` (a late writer's bytes), ``foreign``
    (another tenant's chunk), ``corrupt`` (anything else)."""
    if data == payload(tenant, key).tobytes():
        return "ok"
    if FROZEN_FILL * 4 in data:
        return "frozen"
    if data[:MARKER_LEN] != marker(tenant) and data[:7] == b"KVCHAOS":
        return "foreign"
    return "corrupt"


def is_audit_key(key: bytes) -> bool:
    return key[-1] % 2 == 0


class Events:
    """An append-only JSON-lines file, one flushed line per event."""

    def __init__(self, path: Path) -> None:
        self._file: TextIO = open(path, "a", buffering=1)

    def emit(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"e": event, "t": time.monotonic(), **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Tail:
    """New complete lines of a growing JSON-lines file, parsed, on each :meth:`read`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def read_all(path: Path) -> list[dict[str, Any]]:
    return Tail(path).read()


def stop_requested(workdir: Path) -> bool:
    return os.path.exists(workdir / "stop")
