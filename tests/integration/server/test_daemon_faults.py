"""Faults around a live daemon: clients that die or freeze holding leases, and daemon
restarts (SIGTERM and SIGKILL) under load.

Clients are real processes (``python -c``) talking to a real ``kvfabric serve``; page
accounting is read from ``Client.stats()`` (``tiers[i]["used_bytes"]``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.errors import NotFoundError, ObjectAbortedError, UnavailableError
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.frames import encode_frame
from kvfabric.protocol.messages import Op, request
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("faults", SPEC, tenant_salt="t")
CHUNK = SPEC.chunk_bytes  # 16 KiB: one page
SMALL = [
    "store.tiers.dram.capacity=4MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
]
SHORT_LEASES = [
    *SMALL,
    "store.reservation_timeout_s=1",
    "store.pin_timeout_s=1",
    "store.maintenance_interval_s=0.1",
]
SPILLING = [
    "store.tiers.dram.capacity=512KiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
]


def payload(key: bytes, nbytes: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, nbytes, dtype=np.uint8
    )


def dram_used(client: Client) -> int:
    return client.stats()["tiers"][0]["used_bytes"]


def eventually(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------------- client processes

CHILD_PRELUDE = """
import sys, time
import numpy as np
from kvfabric.client import Client
from kvfabric.errors import KVFabricError
from kvfabric.spec import KVSpec, Namespace
SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("faults", SPEC, tenant_salt="t")
client = Client(sys.argv[1], timeout=30)
key = bytes.fromhex(sys.argv[2])
layer_bytes = SPEC.chunk_bytes // SPEC.num_layers
"""

# reserve, write and commit the first half of the layers, then wait (for ever, or for "go")
CHILD_PUT = (
    CHILD_PRELUDE
    + """
writer = client.reserve(NS, key)
for layer in range(SPEC.num_layers // 2):
    writer.write_layer(layer, np.full(layer_bytes, 0xEE, np.uint8))
    writer.commit_layer(layer)
print("reserved", flush=True)
sys.stdin.readline()
try:
    for layer in range(SPEC.num_layers // 2, SPEC.num_layers):
        writer.write_layer(layer, np.full(layer_bytes, 0xEE, np.uint8))
    writer.commit()
    print("committed", flush=True)
except KVFabricError as exc:
    print("error", exc.kind, flush=True)
except Exception as exc:
    print("error", type(exc).__name__, flush=True)
"""
)

# pin an object, read it, then wait; on "go" read again and release
CHILD_GET = (
    CHILD_PRELUDE
    + """
reader = client.get(NS, key)
first = reader.to_bytes()
print("pinned", len(first), flush=True)
sys.stdin.readline()
try:
    reader.release()
    print("released", flush=True)
except KVFabricError as exc:
    print("error", exc.kind, flush=True)
"""
)


class Child:
    def __init__(self, code: str, socket_path: str, key: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, socket_path, key.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def expect(self, word: str, timeout: float = 60.0) -> str:
        line = self._readline(timeout)
        assert line.startswith(word), f"child said {line!r}, stderr: {self._stderr()}"
        return line

    def _readline(self, timeout: float) -> str:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout)
        assert result, f"child silent for {timeout}s"
        return result[0].strip()

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stderr.read()[-3000:]

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def children():
    started: list[Child] = []

    def start(code: str, socket_path: str, key: bytes) -> Child:
        child = Child(code, socket_path, key)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.signal(signal.SIGCONT)
        child.finish()


# ---------------------------------------------------------------------- dead clients


def test_client_killed_in_the_middle_of_a_put_gives_its_pages_back(start_daemon, children) -> None:
    daemon = start_daemon(*SMALL)
    key = os.urandom(16)
    with Client(daemon.socket) as client:
        baseline = dram_used(client)
        child = children(CHILD_PUT, daemon.socket, key)
        child.expect("reserved")
        assert dram_used(client) == baseline + CHUNK  # the reservation holds its pages
        assert client.contains(NS, [key]) == [True]  # in flight (half the layers committed)
        # a reader already waiting on the unfinished layers must not wait for ever
        waiting = client.get(NS, key)
        assert waiting.ready(0) and not waiting.ready(3)
        aborted_before = client.stats()["aborted_writes"]
        child.signal(signal.SIGKILL)
        with pytest.raises(ObjectAbortedError):
            waiting.wait_layer(3, timeout=20)
        waiting.release()
        eventually(lambda: dram_used(client) == baseline, 5, "pages of the dead writer back")
        assert client.contains(NS, [key]) == [False]  # the half-written object is gone
        with pytest.raises(NotFoundError):
            client.get(NS, key)
        assert client.lookup(NS, keys=[key]).matched_chunks == 0
        assert client.stats()["aborted_writes"] == aborted_before + 1
        # and the key is free again: a complete put of it reads back byte-exact
        assert client.put(NS, key, payload(key))
        with client.get(NS, key) as reader:
            assert reader.to_bytes() == payload(key).tobytes()


def test_client_killed_while_holding_a_pin_releases_it(start_daemon, children) -> None:
    daemon = start_daemon(*SMALL)
    key = os.urandom(16)
    with Client(daemon.socket) as client:
        baseline = dram_used(client)
        assert client.put(NS, key, payload(key))
        child = children(CHILD_GET, daemon.socket, key)
        assert child.expect("pinned") == f"pinned {CHUNK}"
        # deleted while pinned: the pages stay until the last pin goes
        assert client.delete(NS, key) is True
        assert client.contains(NS, [key]) == [False]
        time.sleep(0.5)
        assert dram_used(client) == baseline + CHUNK
        child.signal(signal.SIGKILL)
        eventually(lambda: dram_used(client) == baseline, 5, "pages of the dead reader back")
        # an unpinned object is evictable again: a pinned one would not be
        key2 = os.urandom(16)
        assert client.put(NS, key2, payload(key2))
        child2 = children(CHILD_GET, daemon.socket, key2)
        child2.expect("pinned")
        assert _evict_dram(daemon) == 0  # pinned by the live child: not evictable
        evictions = client.stats()["tiers"][0]["evictions"]
        child2.signal(signal.SIGKILL)
        eventually(lambda: _evict_dram(daemon) >= 1, 5, "the object unpinned and evictable")
        assert client.stats()["tiers"][0]["evictions"] >= evictions + 1
        assert client.contains(NS, [key2]) == [False]


def _evict_dram(daemon) -> int:
    http_request = urllib.request.Request(
        f"{daemon.http_url}/v1/admin/evict",
        method="POST",
        data=json.dumps({"tier": "dram"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(http_request, timeout=10) as response:
        return json.load(response)["evicted"]


# ---------------------------------------------------------------------- stalled clients


def test_stalled_writer_loses_its_reservation_and_its_late_commit_fails(
    start_daemon, children
) -> None:
    daemon = start_daemon(*SHORT_LEASES)
    key = os.urandom(16)
    with Client(daemon.socket) as client:
        baseline = dram_used(client)
        expired_before = client.stats()["expired_leases"]
        child = children(CHILD_PUT, daemon.socket, key)
        child.expect("reserved")
        child.signal(signal.SIGSTOP)
        assert dram_used(client) == baseline + CHUNK
        # the deadline (1 s) passes while the client is frozen: the object is aborted, but
        # its pages stay quarantined (the writer may still copy into them) until its
        # session ends
        eventually(
            lambda: client.stats()["expired_leases"] >= expired_before + 1,
            5,
            "the frozen writer's reservation expired",
        )
        assert client.contains(NS, [key]) == [False]
        assert dram_used(client) == baseline + CHUNK
        # someone else stores the same key meanwhile (in other pages)
        assert client.put(NS, key, payload(key))
        child.signal(signal.SIGCONT)
        child.go()  # the frozen writer wakes up, writes its remaining layers and commits
        line = child.expect("error")
        assert line.split()[1] in ("lease_expired", "bad_request"), line
        # the late writer corrupted nothing: the new object is byte-exact
        with client.get(NS, key) as reader:
            assert reader.to_bytes() == payload(key).tobytes(), (
                "a writer whose reservation expired wrote into pages now owned by another object"
            )
        # the writer's session ends with its process: the quarantined pages come back
        eventually(
            lambda: dram_used(client) == baseline + CHUNK,
            10,
            "quarantined pages back once the frozen writer's session ended",
        )


def test_stalled_writer_without_a_rival_leaves_nothing_behind(start_daemon, children) -> None:
    daemon = start_daemon(*SHORT_LEASES)
    key = os.urandom(16)
    with Client(daemon.socket) as client:
        baseline = dram_used(client)
        child = children(CHILD_PUT, daemon.socket, key)
        child.expect("reserved")
        child.signal(signal.SIGSTOP)
        eventually(
            lambda: client.contains(NS, [key]) == [False],
            5,
            "the frozen writer's object aborted at its deadline",
        )
        assert dram_used(client) == baseline + CHUNK  # quarantined while its session lives
        child.signal(signal.SIGCONT)
        child.go()
        line = child.expect("error")
        assert line.split()[1] in ("lease_expired", "bad_request"), line
        assert client.contains(NS, [key]) == [False]  # absent, not half there
        eventually(
            lambda: dram_used(client) == baseline,
            10,
            "pages of the frozen writer back once its session ended",
        )
        with pytest.raises(NotFoundError):
            client.get(NS, key)
        assert dram_used(client) == baseline


def test_stalled_reader_loses_its_pin(start_daemon, children) -> None:
    daemon = start_daemon(*SHORT_LEASES)
    key = os.urandom(16)
    with Client(daemon.socket) as client:
        baseline = dram_used(client)
        assert client.put(NS, key, payload(key))
        child = children(CHILD_GET, daemon.socket, key)
        child.expect("pinned")
        child.signal(signal.SIGSTOP)
        assert client.delete(NS, key) is True  # storage stays while pinned ...
        assert dram_used(client) == baseline + CHUNK
        # ... but not beyond the pin deadline
        eventually(lambda: dram_used(client) == baseline, 5, "pages of the frozen reader back")
        child.signal(signal.SIGCONT)
        child.go()
        assert child.expect("error").split()[1] == "lease_expired"  # told its read may be torn


def test_pending_layer_waits_of_one_session_do_not_starve_other_clients(start_daemon) -> None:
    """A session may pipeline many wait_layer requests (a decode engine streaming layers,
    or a hostile client): another client's request that has to wait for I/O (a get read
    back from SSD) must still be served promptly, not queue behind those waits until the
    waited-on writer's deadline (6 s here, 30 s by default)."""
    daemon = start_daemon(*SPILLING, "limits.request_threads=8", "store.reservation_timeout_s=6")
    with Client(daemon.socket) as waiter, Client(daemon.socket) as other:
        preloaded = _preload_spilling(other, 48)
        _flush(daemon)
        on_ssd = sorted(_on_ssd(other, list(preloaded)))
        assert len(on_ssd) >= 2
        with other.get(NS, on_ssd[0]) as reader:  # an SSD read-back, before the flood
            assert reader.to_bytes() == preloaded[on_ssd[0]].tobytes()
        key = os.urandom(16)
        writer = waiter.reserve(NS, key)  # not committed while the waits are pending
        reader = waiter.get(NS, key)
        session = waiter._session()
        # the blocking client serialises requests: pipeline raw frames on its socket
        for i in range(40):
            session._sock.sendall(
                encode_frame(
                    request(
                        10_000 + i,
                        Op.WAIT_LAYER,
                        {"lease": reader.lease, "layer": 0, "timeout": 20},
                    )
                )
            )
        time.sleep(0.5)
        started = time.monotonic()
        with other.get(NS, on_ssd[1]) as got:
            assert got.to_bytes() == preloaded[on_ssd[1]].tobytes()
        elapsed = time.monotonic() - started
        session._sock.close()  # end the waiting session: its reservation and waits end too
        del writer
        assert elapsed < 3.0, f"an SSD get took {elapsed:.1f}s queued behind 40 layer waits"


# ---------------------------------------------------------------------- daemon restarts


def _preload_spilling(client: Client, count: int) -> dict[bytes, np.ndarray]:
    """Store a chain of ``count`` chunks (more than DRAM holds)."""
    refs = chunk_hashes(NS, list(range(900_000, 900_000 + count * SPEC.chunk_tokens)))
    stored = {}
    for ref in refs:
        assert client.put(NS, ref.key, payload(ref.key), parent=ref.parent)
        stored[ref.key] = payload(ref.key)
    return stored


def _on_ssd(client: Client, keys: list[bytes]) -> set[bytes]:
    return {
        key
        for key in keys
        if client.lookup(NS, keys=[key]).tier_tokens == {"ssd": SPEC.chunk_tokens}
    }


def _flush(daemon) -> None:
    http_request = urllib.request.Request(f"{daemon.http_url}/v1/admin/flush", method="POST")
    with urllib.request.urlopen(http_request, timeout=60) as response:
        assert json.load(response) == {"flushed": True}


class Worker(threading.Thread):
    """put / get / lookup in a loop through a reconnecting client, until told to stop."""

    def __init__(self, index: int, socket_path: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.index, self.socket_path, self.stop = index, socket_path, stop
        self.acked: dict[bytes, bytes] = {}
        self.ops = 0
        self.ops_at: list[tuple[float, int]] = []
        self.lost_leases = 0  # lease operations cut by the restart (documented behaviour)
        self.missing_after_restart = 0
        self.errors: list[BaseException] = []
        self.rng = random.Random(index)

    def run(self) -> None:
        client = Client(self.socket_path, reconnect_timeout=60)
        try:
            while not self.stop.is_set():
                try:
                    self.step(client)
                except UnavailableError:
                    self.lost_leases += 1  # a lease of the old session: retry the step
                except BaseException as exc:  # reported by the test
                    self.errors.append(exc)
                    return
                self.ops += 1
                self.ops_at.append((time.monotonic(), self.ops))
        finally:
            client.close()

    def step(self, client: Client) -> None:
        key = os.urandom(16)
        data = payload(key)
        if client.put(NS, key, data) is not True:
            raise AssertionError("put of a fresh key answered 'already stored'")
        self.acked[key] = data.tobytes()
        sample = self.rng.sample(list(self.acked), min(3, len(self.acked)))
        for old in sample:
            try:
                with client.get(NS, old) as reader:
                    if reader.to_bytes() != self.acked[old]:
                        raise AssertionError(f"{old.hex()} read back different bytes")
            except NotFoundError:
                # memory tiers are volatile: a restart loses what was in DRAM
                self.missing_after_restart += 1
                del self.acked[old]
        hit = client.lookup(NS, keys=sample)
        if not 0 <= hit.matched_chunks <= len(sample):
            raise AssertionError(f"lookup matched {hit.matched_chunks} of {len(sample)}")


def test_daemon_restarted_under_load(start_daemon, tmp_path) -> None:
    data_dir = tmp_path / "node"
    daemon = start_daemon(*SPILLING, data_dir=data_dir)
    with Client(daemon.socket) as client:
        preloaded = _preload_spilling(client, 48)  # 768 KiB into 512 KiB of DRAM
        _flush(daemon)
        ssd_resident = _on_ssd(client, list(preloaded))
    assert len(ssd_resident) >= 16, "the DRAM tier should have spilled to SSD"

    stop = threading.Event()
    workers = [Worker(i, daemon.socket, stop) for i in range(4)]
    for worker in workers:
        worker.start()
    eventually(
        lambda: all(w.ops >= 20 for w in workers) or any(w.errors for w in workers),
        60,
        "workers running",
    )
    socket_file = Path(daemon.socket)
    assert daemon.stop() == 0  # SIGTERM under load: a clean exit ...
    assert not socket_file.exists()  # ... that removes its socket
    restarted_at = time.monotonic()
    daemon = start_daemon(*SPILLING, data_dir=data_dir)
    eventually(
        lambda: (
            all(_ops_since(w, restarted_at) >= 20 for w in workers)
            or any(w.errors for w in workers)
        ),
        90,
        "workers continuing after the restart",
    )
    stop.set()
    for worker in workers:
        worker.join(60)
        assert not worker.is_alive()
    errors = [e for w in workers for e in w.errors]
    assert not errors, errors
    assert all(_ops_since(w, restarted_at) >= 20 for w in workers)
    assert sum(w.lost_leases for w in workers) <= 2 * len(workers)  # only around the restart

    with Client(daemon.socket) as client:
        # what was on SSD before the restart is still there, byte-exact
        assert client.contains(NS, list(ssd_resident)) == [True] * len(ssd_resident)
        for key in ssd_resident:
            with client.get(NS, key) as reader:
                assert reader.to_bytes() == preloaded[key].tobytes()
        # every acknowledged put a worker still counts as present reads back byte-exact
        for worker in workers:
            for key, data in worker.acked.items():
                try:
                    with client.get(NS, key) as reader:
                        assert reader.to_bytes() == data
                except NotFoundError:
                    pass  # in DRAM at the restart: volatile by design
    assert daemon.stop() == 0


def _ops_since(worker: Worker, moment: float) -> int:
    return sum(1 for at, _ in list(worker.ops_at) if at > moment)


def test_sigterm_exits_zero_and_removes_the_socket_with_leases_open(start_daemon) -> None:
    daemon = start_daemon(*SMALL)
    key, other = os.urandom(16), os.urandom(16)
    client = Client(daemon.socket, reconnect=False)
    assert client.put(NS, other, payload(other))
    writer = client.reserve(NS, key)  # a reservation and a pin open at shutdown
    pinned = Client(daemon.socket, reconnect=False)
    reader = pinned.get(NS, other)
    started = time.monotonic()
    assert daemon.stop(timeout=30) == 0
    assert time.monotonic() - started < 15
    assert not Path(daemon.socket).exists()
    with pytest.raises(UnavailableError):
        writer.commit()
    with pytest.raises(UnavailableError):
        client.ping()
    del reader
    client.close()
    pinned.close()


def test_sigkilled_daemon_restarts_cleanly_over_its_stale_socket(start_daemon, tmp_path) -> None:
    data_dir = tmp_path / "node"
    daemon = start_daemon(*SPILLING, data_dir=data_dir)
    client = Client(daemon.socket, reconnect_timeout=60)
    preloaded = _preload_spilling(client, 48)
    _flush(daemon)
    ssd_resident = _on_ssd(client, list(preloaded))
    assert len(ssd_resident) >= 16
    socket_file = Path(daemon.socket)
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    assert socket_file.exists() and socket_file.is_socket()  # left behind by the crash
    daemon = start_daemon(*SPILLING, data_dir=data_dir)
    assert Path(daemon.socket).is_socket()
    # the same client object reconnects by itself and finds the SSD contents
    assert client.contains(NS, list(ssd_resident)) == [True] * len(ssd_resident)
    for key in ssd_resident:
        with client.get(NS, key) as reader:
            assert reader.to_bytes() == preloaded[key].tobytes()
    stats = client.stats()
    assert stats["tiers"][-1]["corrupt_records"] == 0
    client.close()
    assert daemon.stop() == 0


def test_a_second_daemon_on_a_live_socket_refuses_to_start(start_daemon, tmp_path) -> None:
    daemon = start_daemon(*SMALL)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfabric.cli",
            "serve",
            "--set",
            f"store.data_dir={other_dir}",
            "--set",
            f"socket_path={daemon.socket}",
            "--set",
            "http.port=0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "already" in (proc.stdout + proc.stderr)
    with Client(daemon.socket, reconnect=False) as client:  # the first one is unharmed
        client.ping()
