"""Large legal requests do not hold other clients up (issue 11), on a real daemon process.

A worker process sends the largest requests the protocol allows, back to back: a 65,536-key
``contains``, a lookup of ~1.9 M token ids and a lookup of 65,536 keys, and checks every
answer. Meanwhile this process probes the daemon with pings sent on a fixed schedule (every
5 ms, whether or not the last one was answered, on one multiplexed connection): a daemon
that stops serving for 400 ms shows up as ~80 late pings, not one.

The machines these tests run on are shared and oversubscribed, so a ping can also be late
because the kernel did not run the daemon. Each ping therefore also records, from the
daemon's event-loop thread's ``schedstat``, the CPU time that thread used while the ping
waited (what a blocking request costs the others: ~0.4 s for a contains answered in one go)
and the time it waited for a CPU, which the latency bound leaves out. The bound on the rest
is relative to a baseline measured first, in the same run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pipelined import PipelinedSession

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.messages import Op
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("slices-model", SPEC)
STORED_CHUNKS = 32
PROBE_EVERY_S = 0.005
BASELINE_S = 2.0
ROUNDS = 3  # of the three big requests: the probes overlap all of them, however slow the host

WORKER = r"""
import json, os, sys, time
import numpy as np
from kvfabric.client import Client
from kvfabric.hashing import chunk_keys
from kvfabric.spec import KVSpec, Namespace

socket_path, rounds, stored = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("slices-model", SPEC)
prompt = np.arange(stored * 16, dtype=np.int32)
tokens = np.concatenate([prompt, np.arange(10**6, 10**6 + 1_900_000, dtype=np.int32)])
chain = chunk_keys(NS, tokens, include_partial=False)[:65536]
rng = np.random.default_rng(0)
keys = [rng.bytes(16) for _ in range(65536)]
expected = [False] * 65536
for i in range(stored):  # the stored chunks, scattered through the big contains
    keys[5 + i * 2000], expected[5 + i * 2000] = chain[i], True
os.nice(5)  # this client's own encoding must not starve the daemon of the shared CPUs
client = Client(socket_path, timeout=60, reconnect=False)
client.ping()
print("ready", flush=True)
sys.stdin.readline()
done = {"contains": 0, "lookup_tokens": 0, "lookup_keys": 0}
wrong = []
for _ in range(rounds):
    if client.contains(NS, keys) != expected:
        wrong.append("contains")
    done["contains"] += 1
    result = client.lookup(NS, tokens)
    if (result.requested_chunks, result.matched_chunks) != (len(tokens) // 16, stored):
        wrong.append(("lookup_tokens", result.requested_chunks, result.matched_chunks))
    done["lookup_tokens"] += 1
    result = client.lookup(NS, keys=chain)
    if (result.requested_chunks, result.matched_chunks) != (65536, stored):
        wrong.append(("lookup_keys", result.requested_chunks, result.matched_chunks))
    done["lookup_keys"] += 1
client.close()
print(json.dumps({"done": done, "wrong": wrong[:5]}), flush=True)
"""


@dataclass(frozen=True)
class Probe:
    latency: float  # seconds from sending the ping to its reply, less the daemon's CPU wait
    loop_cpu: float  # seconds of CPU the daemon's loop thread used meanwhile


def schedstat(pid: int) -> tuple[float, float]:
    """(on-CPU, waiting-for-a-CPU) seconds of thread ``pid`` (Linux); zeros elsewhere."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
    except OSError:
        return 0.0, 0.0
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def probe(
    socket_path: str, daemon_pid: int, seconds: float, until: Callable[[], bool] = lambda: False
) -> list[Probe]:
    """Pings sent every PROBE_EVERY_S, whether or not the last one was answered, for
    ``seconds`` or until ``until()``."""
    session = PipelinedSession(socket_path, timeout=60)
    pending: dict[int, tuple[float, float, float]] = {}  # id: sent at, daemon cpu, cpu wait
    probes: list[Probe] = []
    start = time.perf_counter()
    n = 0
    sending = True
    try:
        while sending or pending:
            due = start + n * PROBE_EVERY_S
            sending = sending and due < start + seconds and not until()
            wait = max(0.0, due - time.perf_counter()) if sending else 60.0
            replies = session.receive(wait)
            assert replies or sending, "no reply to a ping within 60 s"
            for request_id, _ in replies:
                sent, cpu, waited = pending.pop(request_id)
                took = time.perf_counter() - sent
                cpu_after, waited_after = schedstat(daemon_pid)
                probes.append(Probe(max(0.0, took - (waited_after - waited)), cpu_after - cpu))
            if sending and time.perf_counter() >= due:
                cpu, waited = schedstat(daemon_pid)
                pending[session.send(Op.PING)] = (time.perf_counter(), cpu, waited)
                n += 1
    finally:
        session.close()
    return probes


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def test_huge_contains_and_lookups_leave_other_clients_served_within_milliseconds(
    start_daemon,
) -> None:
    """While another client sends 65,536-key contains and multi-million-token lookups back
    to back, pings stay fast: their p99 latency within max(50 ms, 20x the baseline p99
    measured just before), the daemon's loop never busy for more than 25 ms (p99) while a
    ping waits, and every big request still gets the right answer.

    Regression: on the old code the daemon answered a 65,536-key contains in one go on its
    event loop (~0.4 s here, 1.2 s on a slower node) and hashed a lookup's ~1.9 M tokens in
    one go (~0.15 s): every other client waited that long, so the probes' p99 (latency and
    loop CPU alike) was hundreds of milliseconds.
    """
    daemon = start_daemon(
        "store.tiers.dram.capacity=8MiB",
        "store.tiers.dram.page_size=4KiB",
        "store.tiers.ssd.capacity=16MiB",
    )
    prompt = np.arange(STORED_CHUNKS * SPEC.chunk_tokens, dtype=np.int32)
    with Client(daemon.socket, timeout=30) as client:
        for ref in chunk_hashes(NS, prompt):
            data = np.full(SPEC.chunk_bytes, ref.key[0], dtype=np.uint8)
            assert client.put(NS, ref.key, data, parent=ref.parent, num_tokens=ref.num_tokens)

    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, daemon.socket, str(ROUNDS), str(STORED_CHUNKS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = daemon.proc.pid
    try:
        assert worker.stdout.readline().strip() == "ready"
        baseline = probe(daemon.socket, pid, BASELINE_S)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        loaded = probe(daemon.socket, pid, 240.0, until=lambda: worker.poll() is not None)
        report = json.loads(worker.stdout.readline())
        assert worker.wait(60) == 0
    finally:
        worker.kill()

    assert report["wrong"] == [], report
    assert report["done"] == dict.fromkeys(report["done"], ROUNDS), report
    latency = p99([p.latency for p in loaded])
    loop_cpu = p99([p.loop_cpu for p in loaded])
    base = p99([p.latency for p in baseline])
    bound = max(0.050, 20 * base)
    summary = (
        f"ping p99 {latency * 1e3:.1f} ms under load (bound {bound * 1e3:.1f} ms, "
        f"baseline p99 {base * 1e3:.2f} ms), loop CPU p99 while a ping waited "
        f"{loop_cpu * 1e3:.1f} ms; {report}"
    )
    assert loop_cpu <= 0.025, summary
    assert latency <= bound, summary
