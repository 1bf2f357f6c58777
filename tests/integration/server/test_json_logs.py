"""``kvfabric --log-format json serve``: everything the daemon writes is JSON lines, and the
lines of a request carry its id, op and namespace (kvfabric.logfmt)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
from daemon_process import DaemonProcess

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("json-logs-model", SPEC, tenant_salt="team-a")
SMALL = ["store.tiers.dram.capacity=8MiB", "store.tiers.ssd.capacity=64MiB"]


def test_every_line_is_json_and_requests_carry_their_fields(tmp_path: Path) -> None:
    # debug: the control plane's access log, one line per request, is at debug level
    daemon = DaemonProcess(
        tmp_path / "node", [*SMALL, "log_level=debug"], cli_args=["--log-format", "json"]
    )
    with daemon.start():
        (ref,) = chunk_hashes(NS, list(range(SPEC.chunk_tokens)))
        data = np.arange(SPEC.chunk_bytes, dtype=np.uint64).astype(np.uint8)
        with Client(daemon.socket) as client:
            assert client.put(NS, ref.key, data, parent=ref.parent)
            with client.get(NS, ref.key) as reader:
                assert reader.to_bytes() == data.tobytes()
        # an HTTP request too: uvicorn's and the API's lines go through the same handler
        body = {"namespace": {"model_id": "m", "spec": {"num_layers": 2}}, "token_ids": [1]}
        httpx.post(f"{daemon.http_url}/v1/lookup", json=body, timeout=10)
        assert daemon.stop() == 0
    text = daemon.log_path.read_text()
    lines = text.splitlines()
    assert len(lines) > 5, text
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{text[-3000:]}") from None
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    ops = {r["op"]: r for r in records if "op" in r and r.get("namespace") == NS.model_id}
    assert {"reserve", "get"} <= set(ops), [r for r in records if "op" in r]
    assert all(isinstance(r["request_id"], int) and r["tenant"] == "team-a" for r in ops.values())
    assert any("shutting down" in r["message"] for r in records)  # the daemon's own lines too


def test_text_stays_the_default(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "node", SMALL).start() as daemon:
        assert daemon.stop() == 0
    first = daemon.log_path.read_text().splitlines()[0]
    assert not first.startswith("{") and " INFO " in first
