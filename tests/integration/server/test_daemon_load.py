"""32 client processes against one daemon for 30 s: put / get / lookup, no errors, nothing
acknowledged lost without being counted, bounded daemon memory.

Sized for 2 slow shared cores: 64 KiB chunks, paced loops (each worker stops by itself at
its deadline or after ``MAX_OPS``), a DRAM tier of 16 MiB in front of a 96 MiB SSD tier so
that the run demotes to SSD and evicts from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np

from kvfabric.client import Client
from kvfabric.errors import NotFoundError
from kvfabric.spec import KVSpec, Namespace

WORKERS = 32
DURATION_S = 30.0
MAX_OPS = 1000  # the bound on each loop; pacing makes the deadline end it first
SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", chunk_tokens=16)
assert SPEC.chunk_bytes == 64 << 10
DRAM = 16 << 20
SETTINGS = [
    f"store.tiers.dram.capacity={DRAM}",
    "store.tiers.dram.page_size=64KiB",
    "store.tiers.ssd.capacity=96MiB",
    "store.tiers.ssd.segment_bytes=8MiB",
]
RSS_MARGIN = 400 << 20

WORKER = r"""
import json, random, sys, time
import numpy as np
from kvfabric.client import Client
from kvfabric.errors import NotFoundError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

socket_path, index, duration, max_ops = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \
    int(sys.argv[4])
SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("load", SPEC, tenant_salt=f"w{index % 4}")
rng = random.Random(index)

def payload(key):
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, SPEC.chunk_bytes, dtype=np.uint8)

client = Client(socket_path, timeout=60, reconnect=False)
client.ping()
print("ready", flush=True)
sys.stdin.readline()
deadline = time.monotonic() + duration
acked, chains, errors = [], [], []
counts = dict(puts=0, gets=0, lookups=0, missing=0, ops=0)
prompt = 0
try:
    while time.monotonic() < deadline and counts["ops"] < max_ops:
        counts["ops"] += 1
        roll = rng.random()
        if roll < 0.25 or not acked:
            # a prompt of 1-2 chunks, each chained to its parent
            tokens = [index * 10_000_000 + prompt * 1000 + t
                      for t in range(rng.randint(1, 2) * SPEC.chunk_tokens)]
            prompt += 1
            refs = chunk_hashes(NS, tokens)
            for ref in refs:
                if client.put(NS, ref.key, payload(ref.key), parent=ref.parent) is not True:
                    raise AssertionError(f"fresh key {ref.key.hex()} already stored")
                acked.append([NS.tenant_salt, ref.key.hex()])
                counts["puts"] += 1
            chains.append([r.key for r in refs])
        elif roll < 0.75:
            tenant, hexkey = rng.choice(acked[-40:])  # recent ones: mostly still stored
            key = bytes.fromhex(hexkey)
            try:
                with client.get(NS, key) as reader:
                    if reader.to_bytes() != payload(key).tobytes():
                        raise AssertionError(f"{hexkey} read back different bytes")
                counts["gets"] += 1
            except NotFoundError:
                counts["missing"] += 1  # evicted: checked against the counters at the end
        else:
            chain = rng.choice(chains)
            hit = client.lookup(NS, keys=chain)
            if not 0 <= hit.matched_chunks <= len(chain) or \
                    hit.matched_tokens != hit.matched_chunks * SPEC.chunk_tokens or \
                    sum(hit.tier_tokens.values()) != hit.matched_tokens:
                raise AssertionError(f"inconsistent lookup {hit}")
            counts["lookups"] += 1
        time.sleep(rng.uniform(0.03, 0.09))
except BaseException as exc:
    errors.append(f"{type(exc).__name__}: {exc}")
client.close()
print(json.dumps({"acked": acked, "errors": errors, **counts}), flush=True)
"""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def payload(key: bytes) -> bytes:
    return (
        np.random.default_rng(int.from_bytes(key[:8], "little"))
        .integers(0, 256, SPEC.chunk_bytes, dtype=np.uint8)
        .tobytes()
    )


def test_32_client_processes_for_30_seconds(start_daemon) -> None:
    daemon = start_daemon(*SETTINGS)
    pid = daemon.proc.pid
    rss_before = rss_bytes(pid)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, daemon.socket, str(i), str(DURATION_S), str(MAX_OPS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(WORKERS)
    ]
    try:
        for proc in procs:  # every worker connected before the clock starts
            line = proc.stdout.readline()
            assert line.strip() == "ready", (line, proc.stderr.read()[-2000:])
        peak = [rss_bytes(pid)]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                peak.append(rss_bytes(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=DURATION_S + 120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    errors = [e for r in results for e in r["errors"]]
    assert not errors, errors[:10]
    assert elapsed < DURATION_S + 60
    assert all(r["ops"] > 0 and r["puts"] > 0 for r in results)
    total = {name: sum(r[name] for r in results) for name in ("puts", "gets", "lookups", "ops")}
    assert total["gets"] > 0 and total["lookups"] > 0

    acked: dict[str, list[bytes]] = {}
    for r in results:
        for tenant, hexkey in r["acked"]:
            acked.setdefault(tenant, []).append(bytes.fromhex(hexkey))
    n_acked = sum(len(keys) for keys in acked.values())
    assert n_acked == total["puts"]

    with Client(daemon.socket, timeout=120) as client:
        stats = client.stats()
        evictions = sum(t["evictions"] for t in stats["tiers"])
        # every commit is either still stored or was evicted (and counted)
        assert stats["puts"] == n_acked
        assert stats["objects"] + evictions == stats["puts"], stats
        missing = read_back = 0
        for tenant, keys in acked.items():
            ns = Namespace("load", SPEC, tenant_salt=tenant)
            present = client.contains(ns, keys)
            missing += present.count(False)
            for key, here in zip(keys, present):
                if here:
                    try:
                        with client.get(ns, key) as reader:
                            assert reader.to_bytes() == payload(key), key.hex()
                        read_back += 1
                    except NotFoundError:
                        missing += 1  # reading SSD objects back evicts others meanwhile
        final = client.stats()
        final_evictions = sum(t["evictions"] for t in final["tiers"])
        # every acknowledged object read back byte-exact, or its eviction was counted
        assert missing <= final_evictions, (missing, final_evictions)
        assert read_back + missing == n_acked
        assert final["objects"] + final_evictions == final["puts"] == n_acked, final
        assert final["tiers"][-1]["corrupt_records"] == 0
        print(
            f"load: {total} in {elapsed:.1f}s, {n_acked} acked, {missing} evicted of "
            f"{final_evictions} evictions, rss peak {max(peak) >> 20} MiB"
        )

    limit = DRAM + RSS_MARGIN
    assert max(peak) < limit, f"daemon RSS peaked at {max(peak) >> 20} MiB"
    assert rss_bytes(pid) < limit
    assert rss_bytes(pid) - rss_before < DRAM + RSS_MARGIN
    assert daemon.stop() == 0
