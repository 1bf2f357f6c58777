"""A real daemon over a disk that fills up, and over a crash after chunks were read back.

The SSD tier of a ``kvfabric serve`` child lives on a small tmpfs the test mounts; the test
fills it with a filler file while clients keep writing, then deletes the filler. Clients,
HTTP probes and the daemon's log are all real.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from small_fs import fill_blocks, tmpfs

from kvfabric.client import Client
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("disk-faults", SPEC, tenant_salt="t")
CHUNK = SPEC.chunk_bytes  # 16 KiB
SPILLING = [
    "store.tiers.dram.capacity=512KiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
    "store.maintenance_interval_s=0.1",
]


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, CHUNK, dtype=np.uint8
    )


def put_fresh(client: Client, n: int) -> dict[bytes, bytes]:
    stored = {}
    for _ in range(n):
        key = os.urandom(16)
        assert client.put(NS, key, payload(key)) is True  # raises on any error
        stored[key] = payload(key).tobytes()
    return stored


def on_ssd(client: Client, keys: list[bytes]) -> set[bytes]:
    return {
        key
        for key in keys
        if client.lookup(NS, keys=[key]).tier_tokens == {"ssd": SPEC.chunk_tokens}
    }


def http(daemon: Any, path: str, method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(f"{daemon.http_url}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode()  # /metrics: Prometheus text


def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)


def test_daemon_on_a_full_disk_degrades_and_recovers(start_daemon, tmp_path: Path) -> None:
    """Regression: on the old code, with the SSD's filesystem full, puts failed with
    ``internal`` errors, the SSD tier's used_bytes leaked to its capacity and then evicted
    what the SSD held (577 -> 210 objects), a segment id was burned per failed attempt, the
    log got a line per failure (29,070), and nothing said the node was degraded."""
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    with tmpfs(data_dir / "disk", size="8m", inodes=64) as fs:
        # a 64 MiB tier on an 8 MiB filesystem on purpose: the disk is meant to fill up
        daemon = start_daemon(
            *SPILLING,
            "store.tiers.ssd.path=disk/ssd",
            "store.allow_overcommit=true",
            data_dir=data_dir,
        )
        segments = fs / "ssd"
        with Client(daemon.socket) as client:
            preloaded = put_fresh(client, 64)  # 1 MiB into 512 KiB of DRAM
            assert http(daemon, "/v1/admin/flush", "POST") == (200, {"flushed": True})
            ssd_resident = on_ssd(client, list(preloaded))
            assert len(ssd_resident) >= 24
            assert http(daemon, "/healthz")[1]["status"] == "ok"

            filler = fill_blocks(fs)
            during = put_fresh(client, 300)  # every put acknowledged, none an error
            status, health = http(daemon, "/healthz")
            assert (status, health["status"], health["degraded"]) == (200, "degraded", ["ssd"])
            status, ready = http(daemon, "/readyz")
            assert (status, ready["status"], ready["degraded"]) == (200, "degraded", ["ssd"])
            status, stats = http(daemon, "/v1/stats")
            ssd = stats["tiers"][-1]
            assert status == 200 and stats["degraded"] == ["ssd"] and ssd["degraded"]
            assert ssd["disk_errors"].get("ENOSPC", 0) >= 1 and ssd["refused_demotions"] > 100
            # nothing the SSD held was lost, and its count is what lookups find there (the
            # maintenance tick may have demoted a few more before the filler took the last page)
            held = on_ssd(client, [*preloaded, *during])
            assert ssd_resident <= held and ssd["evictions"] == 0
            assert ssd["objects"] == len(held)
            metrics = http(daemon, "/metrics")[1]
            assert 'kvfabric_tier_degraded{tier="ssd"} 1.0' in metrics
            assert re.search(
                r'kvfabric_tier_disk_errors_total\{errno="ENOSPC",tier="ssd"\} '
                r"[1-9]",
                metrics,
            )

            # exact accounting: what the segment files hold; no id burned per attempt
            ids = sorted(int(p.name[4:12]) for p in segments.glob("seg-*.kvf"))
            assert ssd["used_bytes"] == sum(p.stat().st_size for p in segments.glob("seg-*"))
            assert ids and ids[-1] <= 8
            for key in ssd_resident:  # what the SSD held is still served, byte-exact
                with client.get(NS, key) as reader:
                    assert reader.to_bytes() == preloaded[key]
            log = daemon.read_log()
            assert log.count("degraded") <= 2 and "SSD demotion of" not in log, log
            assert "Traceback" not in log, log

            os.unlink(filler)  # space returns: the tier recovers by itself
            eventually(
                lambda: http(daemon, "/healthz")[1]["status"] == "ok", 15, "the SSD tier recovering"
            )
            assert http(daemon, "/readyz")[1]["status"] == "ready"
            newer = put_fresh(client, 64)
            assert http(daemon, "/v1/admin/flush", "POST")[0] == 200
            assert on_ssd(client, list(newer)), "new demotions land on SSD again"
            assert http(daemon, "/v1/stats")[1]["degraded"] == []
        assert daemon.stop() == 0


def test_a_chunk_read_back_from_ssd_survives_kill_9(start_daemon, tmp_path: Path) -> None:
    """Regression: on the old code reading a chunk back from SSD (which promotes it into
    DRAM) marked its SSD record dead, so after kill -9 the restarted daemon no longer had
    it, although the README promises that what reached the SSD survives a crash."""
    data_dir = tmp_path / "node"
    daemon = start_daemon(*SPILLING, data_dir=data_dir)
    client = Client(daemon.socket, reconnect_timeout=60)
    try:
        preloaded = put_fresh(client, 48)
        assert http(daemon, "/v1/admin/flush", "POST")[0] == 200
        resident = sorted(on_ssd(client, list(preloaded)))
        assert len(resident) >= 4
        read_back = resident[:4]
        for key in read_back:
            with client.get(NS, key) as reader:
                assert reader.to_bytes() == preloaded[key]
            assert client.lookup(NS, keys=[key]).tier_tokens == {"dram": SPEC.chunk_tokens}
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)
        daemon = start_daemon(*SPILLING, data_dir=data_dir)
        for key in read_back:
            assert client.lookup(NS, keys=[key]).tier_tokens == {"ssd": SPEC.chunk_tokens}
            with client.get(NS, key) as reader:
                assert reader.to_bytes() == preloaded[key]
        assert client.stats()["tiers"][-1]["corrupt_records"] == 0
    finally:
        client.close()
    assert daemon.stop() == 0
