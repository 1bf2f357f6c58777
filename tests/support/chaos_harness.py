"""The chaos and soak harness: two daemons, Redis, tenants' clients and a schedule of faults,
with the invariants checked while it runs. ``benchmarks/soak.py`` (long) and ``tests/chaos``
(CI-sized) both run it; :func:`run` returns every figure of one run.

What runs (each a real process, in its own process group, none outliving the harness:
:mod:`child_process`, :mod:`chaos_procs`, :mod:`redis_process`):

* a ``redis-server`` on a random loopback port, the global index of two ``kvfabric serve``
  nodes (cluster mode, a cluster secret, an admin token and one token per tenant, a small
  DRAM tier and an SSD tier on a tmpfs of its own that the harness mounts; without root the
  SSD is a plain directory and the disk faults are skipped, said in ``notes``);
* per tenant a writer and a reader (:mod:`chaos_workers`), per node a pinger and a session
  opener (``connector``); the auditor and the monitor are threads here;
* the faults of :mod:`chaos_events`, in a fixed order (``Settings.schedule``) or drawn at
  random for ``Settings.duration_s``.

Invariants (the figures :func:`run` returns; targets in ``benchmarks/soak.py``):

* ``corrupt_reads`` -- reads whose bytes were not exactly what the key's writer wrote
  (readers, the frozen writer's victims, the final sweep of every acknowledged chunk);
  ``corrupt_reads_frozen_writer`` are those holding the frozen writer's bytes;
* ``lost_acked_ssd_objects`` -- :mod:`chaos_audit`;
* ``cross_tenant_reads`` -- another tenant's chunk read through the API, plus scans of a
  client's mapped arenas that found another tenant's chunks (``cross_tenant_mapped_pages``:
  the most such pages one scan saw);
* ``ping_p99_ms_under_abuse`` and ``sessions_refused_to_legit_clients`` -- the pinger's
  round trips and the connector's new sessions during ``abuse`` windows, on the attacked node
  (``ping_p99_ms_beside_abuse``: the other node's pings in the same windows, same host load
  without the attack; ``ping_p99_ms_quiet``: pings away from every fault);
* ``rss_growth_mb_per_hour``, ``leaked_fds`` (descriptors other than data files above an
  idle daemon's, once every client is gone), ``leaked_leases`` (objects an evict-all cannot
  move: pinned or reserved, once every client is gone) and ``sessions_at_end``;
* ``kills_survived``, ``enospc_rounds_survived`` (and ``*_total``), ``client_internal_errors``
  (``internal`` or untyped errors any client saw).
* ``engine_outputs_identical`` and the other ``engine_*`` figures -- with ``Settings.engine``:
  a vLLM CPU engine with the connector on one node through the faults (:mod:`chaos_engine`);
  ``None`` without one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from chaos_audit import Auditor, EvictionLedger
from chaos_common import (
    ADMIN_TOKEN,
    SALTS,
    TENANTS,
    TOKENS,
    Events,
    is_audit_key,
    namespace,
    payload,
    read_all,
    verify,
)
from chaos_engine import EngineRun, EngineSettings
from chaos_events import EVENTS
from chaos_monitor import Monitor, rss_slope_mb_per_hour, socket_fds
from chaos_procs import Daemon
from child_process import Child, kill_all, live_children
from redis_process import RedisServer
from small_fs import tmpfs

from kvfabric.client import Client
from kvfabric.errors import KVFabricError, NotFoundError

WORKERS = Path(__file__).with_name("chaos_workers.py")
NODES = ("node-a", "node-b")
PAGE = "16KiB"


@dataclass(frozen=True)
class Settings:
    schedule: tuple[str, ...] = ()  # "kind@node" (node optional); empty: random
    duration_s: float = 0.0  # random schedule: how long faults are drawn
    warmup_s: float = 4.0  # load only, before the first fault
    gap_s: tuple[float, float] = (1.0, 2.0)  # load only, between faults
    write_rate: float = 40.0  # puts per second, per writer (one writer per tenant)
    read_rate: float = 40.0
    keep_chains: int = 40  # per writer and node: older chains are deleted
    dram: str = "2MiB"
    ssd: str = "24MiB"
    disk: str = "40m"  # each node's tmpfs
    lease_s: float = 3.0  # store.reservation_timeout_s
    stop_s: float = 2.0  # SIGSTOP length
    disk_full_s: float = 3.0  # how long a disk stays full once the node says degraded
    abuse_s: float = 8.0
    flood_connections: int = 1100  # more than max_sessions (1024)
    flood_reopen_per_s: float = 200.0
    # the attacker's nice value: it is one local process among many, not one that owns the
    # node's CPUs (the flood is about connection slots and the control loop, not CPU time)
    attacker_nice: int = 10
    slowloris: int = 100
    http_abuse_threads: int = 2  # oversized lookups sent back to back on this many threads
    ping_interval_s: float = 0.01
    rss_warmup_s: float = 10.0
    # negative controls: a planted corrupt chunk, and a reader holding the admin token
    # (which may read every tenant): the checkers must flag both
    negative_controls: bool = False
    settle_s: float = 2.0  # load only, after the last fault, before the figures
    seed: int = 1
    engine: EngineSettings | None = None  # a vLLM engine through the faults: chaos_engine


CHAOS_KINDS = (
    "abuse@node-a",
    "kill9@node-b",
    "disk_fill@node-a",
    "sigstop@node-b",
    "redis_restart",
    "frozen_writer@node-a",
)
# tests/chaos: every kind of fault once, a couple of minutes on two shared cores
CI = Settings(schedule=CHAOS_KINDS, warmup_s=4.0, gap_s=(0.5, 1.0), abuse_s=6.0, disk_full_s=6.0)
# tests/chaos/test_chaos_engine.py: a vLLM engine on node-b through its daemon's faults
ENGINE_CI = Settings(
    schedule=(
        "kill9@node-b",
        "sigstop@node-b",
        "redis_restart",
        "disk_fill@node-b",
        "kill9@node-b",
    ),
    warmup_s=20.0,  # the engine's first passes: the fabric fills before the faults
    gap_s=(2.0, 3.0),
    disk_full_s=6.0,
    settle_s=15.0,  # hits again once the daemon is back
    engine=EngineSettings(stop_every_s=12.0),
)
# the negative controls: no faults, a planted corrupt chunk and an admin-token reader
NEGATIVE = Settings(warmup_s=5.0, settle_s=4.0, negative_controls=True)
# benchmarks/soak.py --quick: every kind once, then each node's turn at the others
QUICK = Settings(
    schedule=(
        *CHAOS_KINDS,
        "kill9@node-a",
        "disk_fill@node-b",
        "abuse@node-b",
        "sigstop@node-a",
        "frozen_writer@node-b",
    ),
    warmup_s=5.0,
    gap_s=(1.0, 2.0),
    engine=EngineSettings(),
)
# benchmarks/soak.py: faults drawn at random for duration_s (every kind once first)
SOAK = Settings(
    duration_s=900.0,
    warmup_s=10.0,
    gap_s=(3.0, 10.0),
    abuse_s=15.0,
    stop_s=3.0,
    disk_full_s=8.0,
    rss_warmup_s=60.0,
    engine=EngineSettings(stop_every_s=60.0),
)


def _node_settings(
    name: str, redis_url: str, secret: Path, s: Settings, on_tmpfs: bool
) -> list[str]:
    settings = [
        f"node_id={name}",
        "log_level=info",
        f"store.tiers.dram.capacity={s.dram}",
        f"store.tiers.dram.page_size={PAGE}",
        "store.tiers.dram.prefault=true",
        f"store.tiers.ssd.capacity={s.ssd}",
        "store.maintenance_interval_s=0.1",
        f"store.reservation_timeout_s={s.lease_s}",
        f"auth.token={ADMIN_TOKEN}",
        *(f"auth.tenants.{TOKENS[t]}={SALTS[t]}" for t in TENANTS),
        "cluster.index=redis",
        f"cluster.redis_url={redis_url}",
        "cluster.heartbeat_s=0.5",
        "cluster.lease_ttl_s=5",
        f"cluster.secret_file={secret}",
        "tcp.port=0",
        "tcp.host=127.0.0.1",
        # the socket transport: the peer plane with a listening port (the one issue 11's
        # bounds are about), and no NIXL start-up in every restart
        "cluster.transport=socket",
    ]
    if on_tmpfs:
        settings.append("store.tiers.ssd.path=disk/ssd")
    return settings


class Harness:
    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings, self.workdir = settings, workdir
        self.rng = random.Random(settings.seed)
        self.daemons: dict[str, Daemon] = {}
        self.disks: dict[str, Path] = {}
        self.disk_note = ""
        self.children: list[Child] = []
        self.records: list[dict[str, Any]] = []
        self.corrupt: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.planted: str | None = None
        self._stack = contextlib.ExitStack()
        # children of this process that are not the harness's (a session's Redis Cluster,
        # say): its teardown's sweep must leave them running
        self._others = live_children()
        self.engine: EngineRun | None = None

    # ------------------------------------------------------------------ processes
    def worker(self, role: str, name: str, cfg: dict[str, Any]) -> Child:
        """A client process running ``role`` (started from this thread: see child_process)."""
        cfg = {"name": name, "workdir": str(self.workdir), **cfg}
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(cfg))
        child = Child(
            name, [sys.executable, str(WORKERS), role, str(path)], self.workdir / f"{name}.log"
        ).start()
        self.children.append(child)
        return child

    def setup(self) -> None:
        s = self.settings
        if s.engine is not None:
            tenant = s.engine.tenant
            self.engine = EngineRun(s.engine, self.workdir, TOKENS[tenant], SALTS[tenant])
            self._stack.callback(self.engine.close)
            self.engine.reference()
            # the node's Daemon.socket: the engine starts before the daemon it will use
            self.engine.start(str(self.workdir / s.engine.node / "kvfabric.sock"))
        self.redis = RedisServer(self.workdir).start()
        secret = self.workdir / "cluster-secret"
        secret.write_bytes(os.urandom(32).hex().encode())
        for node in NODES:
            data_dir = self.workdir / node
            data_dir.mkdir()
            try:
                self.disks[node] = self._stack.enter_context(
                    tmpfs(data_dir / "disk", size=s.disk, inodes=256)
                )
            except pytest.skip.Exception as exc:
                self.disk_note = f"disk faults skipped: {exc.msg}"
                (data_dir / "disk").rmdir()
            daemon = Daemon(
                node,
                data_dir,
                _node_settings(node, self.redis.url, secret, s, node in self.disks),
                ADMIN_TOKEN,
            )
            self.daemons[node] = daemon.start()
        if self.disk_note:
            self.notes.append(self.disk_note)
            self.disks.clear()
        time.sleep(1.0)  # cluster links up, arenas faulted in: what an idle daemon holds
        self.baseline_fds = {n: socket_fds(d) for n, d in self.daemons.items()}
        self.extra = {t: Events(self.workdir / f"extra-{t}.jsonl") for t in TENANTS}
        logs = {
            t: [self.workdir / f"writer-{t}.jsonl", self.workdir / f"extra-{t}.jsonl"]
            for t in TENANTS
        }
        self.ledger = EvictionLedger(lambda node: self.daemons[node].stats(timeout=5))
        self.auditor = Auditor(
            {n: d.socket for n, d in self.daemons.items()},
            ADMIN_TOKEN,
            [p for paths in logs.values() for p in paths],
            self.ledger,
        )
        self.monitor = Monitor(self.daemons)
        sockets = {n: d.socket for n, d in self.daemons.items()}
        for i, tenant in enumerate(TENANTS):
            other = next(t for t in TENANTS if t != tenant)
            self.worker(
                "writer",
                f"writer-{tenant}",
                {
                    "tenant": tenant,
                    "token": TOKENS[tenant],
                    "sockets": sockets,
                    "rate": s.write_rate,
                    "keep_chains": s.keep_chains,
                    "seed": s.seed * 10 + i,
                },
            )
            self.worker(
                "reader",
                f"reader-{tenant}",
                {
                    "tenant": tenant,
                    "token": TOKENS[tenant],
                    "sockets": sockets,
                    "rate": s.read_rate,
                    "seed": s.seed * 10 + i,
                    "cross_share": 0.2,
                    "scan_every_s": 2.0,
                    "own_logs": [str(p) for p in logs[tenant]],
                    "other_logs": [str(p) for p in logs[other]],
                },
            )
        if s.negative_controls:
            self.worker(
                "reader",
                "reader-admin",
                {
                    "tenant": "a",
                    "token": ADMIN_TOKEN,
                    "sockets": sockets,
                    "rate": 10.0,
                    "seed": 99,
                    "cross_share": 0.5,
                    "scan_every_s": 1.0,
                    "own_logs": [str(p) for p in logs["a"]],
                    "other_logs": [str(p) for p in logs["b"]],
                },
            )
        for node, daemon in self.daemons.items():
            self.worker(
                "pinger",
                f"pinger-{node}",
                {"socket": daemon.socket, "token": TOKENS["a"], "interval_s": s.ping_interval_s},
            )
            self.worker(
                "connector",
                f"connector-{node}",
                {"socket": daemon.socket, "token": TOKENS["b"], "interval_s": 0.1, "timeout": 10.0},
            )
        self.auditor.start()
        self.monitor.start()
        if self.engine is not None:
            self.engine.drive()

    def teardown(self) -> None:
        (self.workdir / "stop").touch()
        for child in self.children:
            child.kill()
        for daemon in self.daemons.values():
            if daemon.child is not None:
                daemon.child.kill()
        if hasattr(self, "redis"):
            self.redis.kill()
        self._stack.close()
        kill_all(keep=self._others)

    # ------------------------------------------------------------------ chaos
    def plan(self) -> list[tuple[str, str | None]]:
        s = self.settings
        if s.schedule:
            return [
                (item.split("@")[0], item.split("@")[1] if "@" in item else None)
                for item in s.schedule
            ]
        return []  # drawn as it goes: see chaos()

    def run_event(self, kind: str, node: str | None) -> None:
        if node is None and kind != "redis_restart":
            node = self.rng.choice(NODES)
        started = time.monotonic()
        record = EVENTS[kind](self, node)
        ended = time.monotonic()
        record.setdefault("t0", started)
        record.setdefault("t1", ended)
        record.update(kind=kind, node=node, span=(started, ended), took_s=round(ended - started, 2))
        self.records.append(record)
        print(
            f"[chaos] {kind}@{node}: ok={record['ok']} ({record['took_s']} s)",
            file=sys.stderr,
            flush=True,
        )

    def chaos(self) -> None:
        s = self.settings
        time.sleep(s.warmup_s)
        if s.negative_controls:
            self.plant()
        if s.schedule:
            for kind, node in self.plan():
                self.run_event(kind, node)
                time.sleep(self.rng.uniform(*s.gap_s))
        elif s.duration_s > 0:
            kinds = list(EVENTS)
            self.rng.shuffle(kinds)  # every kind once first, then at random
            end = time.monotonic() + s.duration_s
            while time.monotonic() < end:
                self.run_event(kinds.pop() if kinds else self.rng.choice(list(EVENTS)), None)
                time.sleep(self.rng.uniform(*s.gap_s))
        time.sleep(s.settle_s)

    def plant(self) -> None:
        """The negative control: a chunk of tenant a whose last layer has one byte flipped,
        written by the admin into the arena pages it reserved, then acknowledged like any."""
        node, tenant = NODES[0], "a"
        key = bytearray(os.urandom(16))
        key[-1] |= 1  # readers read it
        key = bytes(key)
        data = payload(tenant, key)
        data[-100] ^= 0x5A
        with Client(self.daemons[node].socket, token=ADMIN_TOKEN) as client:
            with client.reserve(namespace(tenant), key) as writer:
                writer.write(data)  # straight into the reserved arena pages
                writer.commit()
        self.extra[tenant].emit("ack", node=node, tenant=tenant, key=key.hex())
        self.planted = key.hex()

    # ------------------------------------------------------------------ figures
    def stop_workers(self) -> None:
        (self.workdir / "stop").touch()
        for child in self.children:
            if child.wait(20) is None:
                self.notes.append(f"{child.name} did not stop by itself: killed")
                child.kill()

    def final_sweep(self) -> dict[str, int]:
        """Every acknowledged, undeleted chunk read back from its node and verified."""
        known: dict[bytes, tuple[str, str]] = {}
        for tenant in TENANTS:
            for name in (f"writer-{tenant}", f"extra-{tenant}"):
                for event in read_all(self.workdir / f"{name}.jsonl"):
                    key = bytes.fromhex(event.get("key", "")) if "key" in event else b""
                    if event["e"] == "ack":
                        known[key] = (event["node"], tenant)
                    elif event["e"] == "del":
                        known.pop(key, None)
        verdicts: Counter = Counter()
        clients = {
            n: Client(d.socket, token=ADMIN_TOKEN, timeout=10) for n, d in self.daemons.items()
        }
        try:
            for key, (node, tenant) in known.items():
                try:
                    with clients[node].get(namespace(tenant), key) as reader:
                        how = verify(tenant, key, reader.to_bytes())
                except NotFoundError:
                    how = "not_found"
                except KVFabricError as exc:
                    how = f"error_{exc.kind}"
                verdicts[how] += 1
                if how in ("corrupt", "frozen", "foreign"):
                    self.corrupt.append(
                        {
                            "source": "final_sweep",
                            "node": node,
                            "tenant": tenant,
                            "key": key.hex(),
                            "how": how,
                            "audit_key": is_audit_key(key),
                        }
                    )
        finally:
            for client in clients.values():
                client.close()
        return dict(verdicts)

    def worker_reports(self) -> dict[str, Any]:
        errors: Counter = Counter()
        cross: list[dict[str, Any]] = []
        counts: dict[str, dict[str, int]] = {}
        crashed = []
        for path in sorted(self.workdir.glob("*.jsonl")):
            name = path.stem
            for event in read_all(path):
                if event["e"] == "err":
                    errors[event["kind"]] += 1
                elif event["e"] == "corrupt":
                    self.corrupt.append(
                        {"source": name, **{k: event[k] for k in ("node", "tenant", "key", "how")}}
                    )
                elif event["e"] == "cross":
                    cross.append({"worker": name, **event})
                elif event["e"] == "counts":
                    counts[name] = event["counts"]
                elif event["e"] == "crashed":
                    crashed.append(f"{name}: {event['error']}")
        for name, c in counts.items():
            for kind, n in c.items():
                if kind.startswith("untyped") or kind == "internal":
                    errors[f"{name}:{kind}"] += n
        return {"errors": errors, "cross": cross, "counts": counts, "crashed": crashed}

    def windows(self, kind: str) -> list[tuple[str, float, float]]:
        return [(r["node"], r["t0"], r["t1"]) for r in self.records if r["kind"] == kind]

    def ping_figures(self) -> dict[str, Any]:
        abuse = self.windows("abuse")
        busy = [(r["node"], *r["span"]) for r in self.records]
        under, beside, quiet, refused, tried, slowest = [], [], [], Counter(), 0, 0.0
        for node in NODES:
            for line in _lines(self.workdir / f"pinger-{node}.pings"):
                start, ms, _ = line.split()
                t, value = float(start), float(ms)
                if any(n == node and t0 <= t <= t1 for n, t0, t1 in abuse):
                    under.append(value)
                elif any(n != node and t0 <= t <= t1 for n, t0, t1 in abuse):
                    beside.append(value)
                elif not any(t0 - 1 <= t <= t1 + 1 for _, t0, t1 in busy):
                    quiet.append(value)
            for line in _lines(self.workdir / f"connector-{node}.sessions"):
                start, took, ok, kind = line.split()
                if any(n == node and t0 <= float(start) <= t1 for n, t0, t1 in abuse):
                    tried += 1
                    slowest = max(slowest, float(took))
                    if ok != "1":
                        refused[kind] += 1
        return {
            "ping_p99_ms_under_abuse": _p99(under),
            "ping_samples_under_abuse": len(under),
            "ping_max_ms_under_abuse": max(under, default=None),
            "ping_p99_ms_beside_abuse": _p99(beside),
            "ping_samples_beside_abuse": len(beside),
            "ping_p99_ms_quiet": _p99(quiet),
            "sessions_refused_to_legit_clients": sum(refused.values()),
            "sessions_refused_by_kind": dict(refused),
            "legit_sessions_under_abuse": tried,
            "legit_session_max_s_under_abuse": round(slowest, 3) if tried else None,
        }

    def end_state(self) -> dict[str, Any]:
        """Every client gone: sessions, descriptors and leases back to an idle daemon's."""
        sessions, fds, leases, pinned_bytes = {}, {}, 0, 0
        for node, daemon in self.daemons.items():
            _settle(lambda: daemon.stats()["sessions"] == 0, 15)  # noqa: B023 (called at once)
            stats = daemon.stats()
            sessions[node] = stats["sessions"]
            now = socket_fds(daemon)
            fds[node] = sum(now.values()) - sum(self.baseline_fds[node].values())
            grown = {
                k: n - self.baseline_fds[node][k]
                for k, n in now.items()
                if n != self.baseline_fds[node][k]
            }
            if grown:
                self.notes.append(f"{node}: descriptors at end minus idle: {grown}")
            evicted = daemon.http("POST", "/v1/admin/evict", json={}, timeout=60)
            after = daemon.stats()
            memory = [t for t in after["tiers"] if t["kind"] != "ssd"]
            leases += sum(int(t["objects"]) for t in memory)
            pinned_bytes += sum(int(t["used_bytes"]) for t in memory)
            if evicted.status_code != 200:
                self.notes.append(f"{node}: evict-all answered {evicted.status_code}")
        return {
            "sessions_at_end": sum(sessions.values()),
            "leaked_fds": sum(max(0, n) for n in fds.values()),
            "fd_delta_by_node": fds,
            "leaked_leases": leases,
            "memory_bytes_held_after_evict_all": pinned_bytes,
        }

    def figures(self) -> dict[str, Any]:
        s = self.settings
        engine = self.engine.finish(self.records) if self.engine else {}
        self.stop_workers()
        self.auditor.finish()
        self.monitor.stop()
        (self.workdir / "monitor.json").write_text(json.dumps(self.monitor.dump()))
        sweep = self.final_sweep()
        reports = self.worker_reports()
        end = self.end_state()
        cross_api = [c for c in reports["cross"] if c["how"] != "mapped"]
        mapped = max((c["pages"] for c in reports["cross"] if c["how"] == "mapped"), default=0)
        scans = sum(
            c.get("scans", 0) for n, c in reports["counts"].items() if n.startswith("reader")
        )
        own_pages = max(
            (
                c.get("scan_own_pages", 0)
                for n, c in reports["counts"].items()
                if n.startswith("reader")
            ),
            default=0,
        )
        slopes = [rss_slope_mb_per_hour(self.monitor.samples[n], s.rss_warmup_s) for n in NODES]
        kills = [r for r in self.records if r["kind"] == "kill9"]
        rounds = [r for r in self.records if r["kind"] == "disk_fill" and r["ok"] is not None]
        acked = sum(
            c.get("acked", 0) for n, c in reports["counts"].items() if n.startswith("writer")
        )
        reads_ok = sum(
            c.get("read_ok", 0) for n, c in reports["counts"].items() if n.startswith("reader")
        )
        audit = self.auditor.summary()
        frozen = [c for c in self.corrupt if c["how"] == "frozen"]
        planted = [c for c in self.corrupt if c["key"] == self.planted]
        return {
            "corrupt_reads": len(self.corrupt),
            "corrupt_reads_frozen_writer": len(frozen),
            "corrupt_reads_other": len(self.corrupt) - len(frozen) - len(planted),
            "planted_corrupt_detected": len(planted) if self.planted else None,
            "lost_acked_ssd_objects": audit["lost"],
            "cross_tenant_reads": len(cross_api) + (1 if mapped else 0),
            "cross_tenant_reads_api": len(cross_api),
            "cross_tenant_mapped_pages": mapped,
            **self.ping_figures(),
            "rss_growth_mb_per_hour": max((x for x in slopes if x is not None), default=None),
            "rss_peak_mb": round(self.monitor.peak_rss_mb(), 1),
            **end,
            "kills_survived": sum(1 for r in kills if r["ok"]),
            "kills_total": len(kills),
            "enospc_rounds_survived": sum(1 for r in rounds if r["ok"]),
            "enospc_rounds_total": len(rounds),
            "client_internal_errors": sum(
                n for k, n in reports["errors"].items() if "internal" in k or "untyped" in k
            ),
            "engine_outputs_identical": None,
            **engine,
            "acked_puts": acked,
            "verified_reads": reads_ok,
            "final_sweep": sweep,
            "ssd_audit": audit,
            "mapped_scans": scans,
            "mapped_scan_own_pages": own_pages,
            "client_errors": dict(reports["errors"]),
            "worker_crashes": reports["crashed"],
            "events": [
                {k: v for k, v in r.items() if k not in ("t0", "t1", "span")} for r in self.records
            ],
            "corrupt_samples": self.corrupt[:10],
            "cross_samples": cross_api[:10],
            "planted_key": self.planted,
            "notes": self.notes,
            "settings": asdict(self.settings),
        }


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.count(" ") >= 2]
    except OSError:
        return []


def _p99(samples: list[float]) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(0.99 * (len(ordered) - 1) + 0.5))], 3)


def _settle(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def run(settings: Settings, workdir: Path) -> dict[str, Any]:
    """One whole run in ``workdir`` (kept: logs and event files); every figure."""
    workdir.mkdir(parents=True, exist_ok=True)
    harness = Harness(settings, workdir)
    started = time.monotonic()
    try:
        harness.setup()
        harness.chaos()
        figures = harness.figures()
    finally:
        harness.teardown()
    figures["wall_s"] = round(time.monotonic() - started, 1)
    figures["workdir"] = str(workdir)
    (workdir / "figures.json").write_text(json.dumps(figures, indent=1, default=str))
    return figures
