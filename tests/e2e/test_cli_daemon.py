"""`kvfabric serve`, `status` and `lookup` against a real daemon in its own process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
NS = Namespace("e2e/model", SPEC, tenant_salt="team-a")
NS_ARGS = [
    "--model",
    "e2e/model",
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--chunk-tokens",
    "16",
]
PROMPT = np.arange(100, 140, dtype=np.int32)  # 2 full chunks + 8 tokens
READY_TIMEOUT_S = 60
STOP_TIMEOUT_S = 20

Started = tuple[subprocess.Popen[bytes], dict[str, Any]]  # the daemon, its ready file


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )


def _wait_ready(daemon: subprocess.Popen[bytes], ready: Path, log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if daemon.poll() is not None:
            pytest.fail(f"daemon exited with {daemon.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"daemon not ready after {READY_TIMEOUT_S} s:\n{log.read_text()}")
        time.sleep(0.05)
    return dict(json.loads(ready.read_text()))


@contextlib.contextmanager
def _serve(tmp_path: Path, *extra: str) -> Iterator[Started]:
    ready, log = tmp_path / "ready.json", tmp_path / "daemon.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvfabric.cli",
                "serve",
                "--data-dir",
                str(tmp_path / "d"),
                "--http-port",
                "0",
                "--ready-file",
                str(ready),
                "--set",
                "store.tiers.dram.capacity=64MiB",
                "--set",
                "store.tiers.ssd.capacity=256MiB",
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    try:
        yield process, _wait_ready(process, ready, log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Started]:
    with _serve(tmp_path) as started:
        yield started


def _put_prompt(socket_path: str) -> None:
    with Client(socket_path, reconnect=False) as client:
        for ref in chunk_hashes(NS, PROMPT):
            if ref.num_tokens == SPEC.chunk_tokens:  # only full chunks serve prefix reuse
                data = np.full(SPEC.chunk_bytes, ref.key[0], dtype=np.uint8)
                assert client.put(NS, ref.key, data, parent=ref.parent)


def test_serve_status_lookup_and_sigterm(daemon: Started, tmp_path: Path) -> None:
    process, info = daemon
    sock = info["socket"]
    assert info["pid"] == process.pid and info["http_port"] and Path(sock).is_socket()
    _put_prompt(sock)
    prompt_file = tmp_path / "prompt.json"
    prompt_file.write_text(json.dumps(PROMPT.tolist()))

    out = _cli(
        "lookup",
        *NS_ARGS,
        "--tenant",
        "team-a",
        "--tokens-file",
        str(prompt_file),
        "--socket",
        sock,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("matched 32 / 40 tokens")
    assert "2 / 2 full chunks of 16 tokens" in out.stdout
    assert out.stdout.splitlines()[1].split() == ["dram", "32", "tokens"]

    out = _cli(
        "lookup", *NS_ARGS, "--tokens", " ".join(map(str, PROMPT)), "--socket", sock, "--json"
    )  # no tenant: another namespace, nothing shared
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "matched_tokens": 0,
        "total_tokens": 40,
        "matched_chunks": 0,
        "requested_chunks": 2,
        "chunk_tokens": 16,
        "tiers": {},
    }

    out = _cli("status", "--socket", sock)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"kvfabric node {info['node_id']}")
    dram = next(line for line in out.stdout.splitlines() if line.startswith("dram "))
    cells = dram.split()
    assert cells[2:4] == ["64.0", "MiB"] and cells[7:9] == ["2", "32"]  # objects, hit tokens
    assert "token hit rate 50.0% (32 of 64 tokens looked up, 2 lookups)" in out.stdout
    assert "puts 2" in out.stdout
    assert any(line.split() == ["team-a", "1", "100.0%"] for line in out.stdout.splitlines())

    over_http = _cli("status", "--url", f"http://127.0.0.1:{info['http_port']}", "--json")
    over_socket = _cli("status", "--socket", sock, "--json")
    assert over_http.returncode == over_socket.returncode == 0, over_http.stderr
    http_doc, socket_doc = json.loads(over_http.stdout), json.loads(over_socket.stdout)
    assert http_doc["ready"] is True and http_doc["node_id"] == socket_doc["node_id"]
    assert http_doc["totals"]["hit_tokens"] == socket_doc["totals"]["hit_tokens"] == 32
    assert [t["name"] for t in http_doc["tiers"]] == [t["name"] for t in socket_doc["tiers"]]
    assert set(http_doc["totals"]) == set(socket_doc["totals"])

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=STOP_TIMEOUT_S) == 0
    assert not Path(sock).exists()
    out = _cli("status", "--socket", sock)
    assert out.returncode == 1 and "cannot reach the kvfabric daemon" in out.stderr


def test_status_and_lookup_present_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("e2e-secret\n")
    with _serve(tmp_path, "--auth-token-file", str(token_file)) as (process, info):
        url = f"http://127.0.0.1:{info['http_port']}"
        for where in (["--socket", info["socket"]], ["--url", url]):
            out = _cli("status", *where)
            assert out.returncode == 1 and "token" in out.stderr, out.stderr
            assert "Traceback" not in out.stderr and "e2e-secret" not in out.stderr
            out = _cli("status", *where, "--token", "e2e-secret", "--json")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["node_id"] == info["node_id"]
        out = _cli(
            "lookup", *NS_ARGS, "--tokens", "1 2 3", "--socket", info["socket"], "--token", "wrong"
        )
        assert out.returncode == 1 and "token" in out.stderr
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_TIMEOUT_S) == 0
