"""The chaos harness's faults, one function each: ``event(harness, node) -> record``.

Each runs in the harness's main thread while the writers, readers, pingers and connectors
keep going, and returns what happened (``ok``: the system came through it as promised) and
the window it covered (``t0``..``t1``, monotonic: the ping and session figures are computed
per window). A fault that restarts a node holds the auditor's lock of that node from the
kill until the eviction ledger knows of the restart.

* ``kill9`` -- SIGKILL of a daemon's process group, restart on the same data directory and
  disk; ok when the chunks the auditor had seen on its SSD are all there again and a put and
  a get work;
* ``sigstop`` -- SIGSTOP, a few seconds, SIGCONT; ok when it answers again;
* ``redis_restart`` -- the global index's Redis killed and started empty; ok when a chunk put
  on one node afterwards shows up in the other node's cluster-wide lookup;
* ``disk_fill`` -- a filler file takes every free block of the node's SSD filesystem while
  the writers go on, then is deleted; ok when the node reported ``degraded``, lost nothing
  it had on SSD, and came back to ``ok`` by itself;
* ``abuse`` -- the attacker (:mod:`chaos_flood`) against one node for a while: its window
  is where ``ping_p99_ms_under_abuse`` and ``sessions_refused_to_legit_clients`` come from;
* ``frozen_writer`` -- a client reserves a chunk, is SIGSTOPped until the daemon reaped its
  lease, then chunks are put on the same node and tenant (the *victims*), the client is
  SIGCONTed and writes through its old page views; ok when its commit is refused and every
  victim reads back byte-exact.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from chaos_common import ADMIN_TOKEN, SPEC, TOKENS, Tail, namespace, payload, verify
from small_fs import fill_blocks

from kvfabric.client import Client
from kvfabric.errors import KVFabricError
from kvfabric.protocol.messages import encode_namespace
from kvfabric.spec import Namespace

if TYPE_CHECKING:
    from chaos_harness import Harness

PROBE_NS = Namespace("chaos-probe", SPEC)  # no tenant: the admin's own probes


def _odd_key() -> bytes:
    """A fresh key readers read (not an audit key)."""
    key = bytearray(os.urandom(16))
    key[-1] |= 1
    return bytes(key)


def _wait(predicate: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except Exception:
            pass
        time.sleep(step)
    return False


def _probe_roundtrip(socket: str) -> bool:
    key = os.urandom(16)
    data = payload("a", key)
    try:
        with Client(socket, token=ADMIN_TOKEN, timeout=10, reconnect_timeout=20) as client:
            client.put(PROBE_NS, key, data)
            with client.get(PROBE_NS, key) as reader:
                ok = reader.to_bytes() == data.tobytes()
            client.delete(PROBE_NS, key)
            return ok
    except KVFabricError:
        return False


def kill9(h: Harness, node: str) -> dict[str, Any]:
    daemon = h.daemons[node]
    with h.auditor.node_locks[node]:
        h.ledger.before_kill(node)
        t0 = time.monotonic()
        daemon.kill9()
        time.sleep(h.rng.uniform(0.2, 1.0))
        daemon.start()
        h.ledger.restarted(node)
        back_s = time.monotonic() - t0
    lost = h.auditor.verify_node(node)
    roundtrip = _probe_roundtrip(daemon.socket)
    return {
        "ok": lost == 0 and roundtrip,
        "t0": t0,
        "restart_s": round(back_s, 2),
        "lost_after_restart": lost,
        "roundtrip": roundtrip,
    }


def sigstop(h: Harness, node: str) -> dict[str, Any]:
    daemon = h.daemons[node]
    assert daemon.child is not None
    t0 = time.monotonic()
    daemon.child.signal(signal.SIGSTOP)
    time.sleep(h.settings.stop_s)
    daemon.child.signal(signal.SIGCONT)
    answered = _wait(lambda: daemon.health(timeout=2) in ("ok", "degraded"), 20)
    return {
        "ok": answered and _probe_roundtrip(daemon.socket),
        "t0": t0,
        "stopped_s": h.settings.stop_s,
    }


def _cluster_sees(observer: Any, owner: str, key: bytes) -> bool:
    body = {
        "namespace": encode_namespace(PROBE_NS),
        "chunk_hashes": [key.hex()],
        "scope": "cluster",
    }
    answer = observer.http("POST", "/v1/lookup", json=body, timeout=5).json()
    return any(n["node_id"] == owner for n in answer.get("nodes", []))


def redis_restart(h: Harness, node: str | None) -> dict[str, Any]:
    t0 = time.monotonic()
    h.redis.restart()
    owner, observer = sorted(h.daemons)
    key = os.urandom(16)
    try:
        with Client(
            h.daemons[owner].socket, token=ADMIN_TOKEN, timeout=10, reconnect_timeout=20
        ) as client:
            client.put(PROBE_NS, key, payload("a", key))
    except KVFabricError as exc:
        return {"ok": False, "t0": t0, "error": exc.kind}
    seen = _wait(lambda: _cluster_sees(h.daemons[observer], owner, key), 30, 0.25)
    return {"ok": seen, "t0": t0, "seen_after_s": round(time.monotonic() - t0, 2)}


def disk_fill(h: Harness, node: str) -> dict[str, Any]:
    daemon, fs = h.daemons[node], h.disks.get(node)
    if fs is None:
        return {"ok": None, "t0": time.monotonic(), "skipped": h.disk_note}
    t0 = time.monotonic()
    evictions_before = h.ledger.poll(node)
    filler = fill_blocks(fs, name="chaos-filler")
    degraded = _wait(lambda: daemon.health() == "degraded", h.settings.disk_full_s + 15)
    time.sleep(h.settings.disk_full_s)
    lost_while_full = h.auditor.verify_node(node)
    os.unlink(filler)
    t_freed = time.monotonic()
    recovered = _wait(lambda: daemon.health() == "ok", 30)
    lost = lost_while_full + h.auditor.verify_node(node)
    record = {
        "ok": degraded and recovered and lost == 0,
        "t0": t0,
        "degraded_seen": degraded,
        "recovered_s": round(time.monotonic() - t_freed, 2) if recovered else None,
        "lost": lost,
        # counted, so not "lost"; but a full disk is no reason to drop what SSD holds
        "ssd_evictions_during": h.ledger.poll(node) - evictions_before,
    }
    if not recovered:  # what the disk and the tier looked like, for the report
        vfs = os.statvfs(fs)
        ssd = next(t for t in daemon.stats()["tiers"] if t["kind"] == "ssd")
        record.update(
            free_bytes=vfs.f_bavail * vfs.f_frsize,
            free_inodes=vfs.f_favail,
            files={
                str(p.relative_to(fs)): p.stat().st_size
                for p in sorted(fs.rglob("*"))
                if p.is_file()
            },
            ssd={
                k: ssd.get(k)
                for k in ("used_bytes", "capacity_bytes", "objects", "disk_errors", "degraded")
            },
        )
    return record


def abuse(h: Harness, node: str) -> dict[str, Any]:
    daemon = h.daemons[node]
    name = f"flood-{len(h.records)}"
    child = h.worker(
        "flood",
        name,
        {
            "socket": daemon.socket,
            "http_host": "127.0.0.1",
            "http_port": daemon.info["http_port"],
            "tenant": "a",
            "token": TOKENS["a"],
            "connections": h.settings.flood_connections,
            "reopen_per_s": h.settings.flood_reopen_per_s,
            "slowloris": h.settings.slowloris,
            "http_threads": h.settings.http_abuse_threads,
            "nice": h.settings.attacker_nice,
        },
    )
    flooding = h.workdir / f"{name}.flooding"
    _wait(flooding.exists, 20, 0.05)
    t0 = time.monotonic()
    time.sleep(h.settings.abuse_s)
    (h.workdir / f"stop-{name}").touch()
    if child.wait(90) is None:
        child.kill()
    counts: dict[str, int] = {}
    for event in Tail(h.workdir / f"{name}.jsonl").read():
        if event["e"] == "counts":
            counts = event["counts"]
    t1 = time.monotonic()
    alive = _wait(lambda: daemon.health(timeout=2) in ("ok", "degraded"), 10)
    return {
        "ok": alive,
        "t0": t0,
        "t1": t1,
        "flood": counts,
        "daemon_cpu_share": h.monitor.cpu_share(node, t0, t1),
    }


def frozen_writer(h: Harness, node: str) -> dict[str, Any]:
    daemon, tenant = h.daemons[node], "a"
    ns = namespace(tenant)
    name = f"frozen-{len(h.records)}"
    t0 = time.monotonic()
    child = h.worker(
        "frozen",
        name,
        {
            "socket": daemon.socket,
            "tenant": tenant,
            "token": TOKENS[tenant],
            "key": _odd_key().hex(),
        },
    )
    events = Tail(h.workdir / f"{name}.jsonl")
    seen: list[dict[str, Any]] = []

    def has(kind: str) -> bool:
        seen.extend(events.read())
        return any(e["e"] == kind for e in seen)

    if not _wait(lambda: has("reserved"), 30, 0.05):
        child.kill()
        return {
            "ok": False,
            "t0": t0,
            "error": "the frozen writer never reserved",
            "log": child.tail(800),
        }
    expired0 = daemon.stats()["totals"]["expired_leases"]
    assert child.alive
    child.signal(signal.SIGSTOP)
    reaped = _wait(
        lambda: daemon.stats()["totals"]["expired_leases"] > expired0,
        h.settings.lease_s * 3 + 10,
        0.2,
    )
    victims: dict[bytes, np.ndarray] = {}
    with Client(daemon.socket, token=TOKENS[tenant], timeout=10) as client:
        for _ in range(16):
            key = _odd_key()
            if client.put(ns, key, payload(tenant, key)):
                victims[key] = payload(tenant, key)
                h.extra[tenant].emit("ack", node=node, tenant=tenant, key=key.hex())
        (h.workdir / f"go-{name}").touch()
        child.signal(signal.SIGCONT)
        _wait(lambda: has("frozen_done"), 30, 0.05)
        outcome = next((e["outcome"] for e in seen if e["e"] == "frozen_done"), "no answer")
        verdicts: dict[str, int] = {}
        for key in victims:
            try:
                with client.get(ns, key) as reader:
                    how = verify(tenant, key, reader.to_bytes())
            except KVFabricError as exc:
                how = exc.kind
            verdicts[how] = verdicts.get(how, 0) + 1
            if how not in ("ok", "not_found"):
                h.corrupt.append(
                    {
                        "source": "frozen_victims",
                        "node": node,
                        "tenant": tenant,
                        "key": key.hex(),
                        "how": how,
                    }
                )
    if child.wait(10) is None:
        child.kill()
    clean = verdicts.get("ok", 0) + verdicts.get("not_found", 0) == len(victims)
    return {
        "ok": reaped and outcome == "lease_expired" and clean,
        "t0": t0,
        "lease_reaped": reaped,
        "commit": outcome,
        "victims": verdicts,
    }


EVENTS = {
    "kill9": kill9,
    "sigstop": sigstop,
    "redis_restart": redis_restart,
    "disk_fill": disk_fill,
    "abuse": abuse,
    "frozen_writer": frozen_writer,
}
