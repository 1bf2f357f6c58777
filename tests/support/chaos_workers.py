"""The chaos harness's client processes: ``python chaos_workers.py ROLE CONFIG.json``.

Every role is a legitimate user of the public client (``kvfabric.client.Client`` with a
tenant token), reports through its own event file (:mod:`chaos_common`) and ends when the
harness creates ``<workdir>/stop``:

* ``writer`` -- puts chains of chunks (payload derived from the key) alternately on every
  node at a steady rate, acknowledges each committed chunk, keeps a window of recent chains
  and deletes older ones (``del`` first);
* ``reader`` -- gets its own tenant's acknowledged chunks (not the audit keys) and verifies
  every byte; tries the other tenant's chunks through the API (another tenant's namespace
  must be ``forbidden``, the other tenant's raw key in its own namespace ``not_found``); and
  scans every daemon arena it has mapped for chunks that carry the other tenant's marker;
* ``pinger`` -- pings one node every few ms on one session, logging each round trip;
* ``connector`` -- opens a new session (hello with a tenant token) and pings, over and over:
  a failure is a session refused to a legitimate client;
* ``frozen`` -- reserves a chunk, takes the views of its pages, says ``reserved`` and waits
  for ``<workdir>/go-<name>`` (the harness SIGSTOPs it past its lease meanwhile), then writes
  :data:`chaos_common.FROZEN_FILL` through the old views and tries to commit;
* ``flood`` -- the attacker (:mod:`chaos_flood`).

Untyped exceptions from the client are counted (``untyped``), never raised: the client
promises typed errors only.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
import traceback
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np
from chaos_common import (
    CHUNK,
    FROZEN_FILL,
    MARKER_LEN,
    SPEC,
    TENANTS,
    Events,
    Tail,
    is_audit_key,
    marker,
    namespace,
    payload,
    stop_requested,
    verify,
)
from chaos_flood import flood

from kvfabric.client import Client
from kvfabric.errors import ForbiddenError, KVFabricError, NotFoundError
from kvfabric.hashing import chunk_hashes

CHAIN = 4  # chunks per prompt a writer puts
PAGE = 16 << 10  # the daemons' page size (chaos_harness sets it): chunks start on pages


def _client(socket: str, token: str, timeout: float = 10.0) -> Client:
    return Client(socket, token=token, timeout=timeout, reconnect_timeout=60.0)


def _untyped(counts: Counter, exc: BaseException) -> None:
    counts[f"untyped:{type(exc).__name__}"] += 1
    traceback.print_exc()


def _pace(next_at: float, period: float) -> float:
    delay = next_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
        return next_at + period
    return time.monotonic() + period  # late: do not burst to catch up


def writer(cfg: dict[str, Any], workdir: Path, events: Events) -> None:
    tenant, ns = cfg["tenant"], namespace(cfg["tenant"])
    clients = {node: _client(sock, cfg["token"]) for node, sock in cfg["sockets"].items()}
    nodes = sorted(clients)
    np_rng = np.random.default_rng(cfg["seed"])
    kept: dict[str, deque[list[bytes]]] = {node: deque() for node in nodes}
    counts: Counter = Counter()
    period, next_at, chain_no = 1.0 / cfg["rate"], time.monotonic(), 0
    while not stop_requested(workdir):
        node = nodes[chain_no % len(nodes)]
        chain_no += 1
        client, chain = clients[node], []
        for ref in chunk_hashes(ns, np_rng.integers(0, 60_000, CHAIN * SPEC.chunk_tokens)):
            next_at = _pace(next_at, period)
            try:
                stored = client.put(ns, ref.key, payload(tenant, ref.key), parent=ref.parent)
            except KVFabricError as exc:
                counts[exc.kind] += 1
                events.emit("err", op="put", kind=exc.kind, node=node, msg=str(exc)[:200])
                break
            except Exception as exc:
                _untyped(counts, exc)
                break
            if stored:
                counts["acked"] += 1
                chain.append(ref.key)
                events.emit("ack", node=node, tenant=tenant, key=ref.key.hex())
        kept[node].append(chain)
        while len(kept[node]) > cfg["keep_chains"]:
            for key in reversed(kept[node].popleft()):  # leaves first
                events.emit("del", node=node, tenant=tenant, key=key.hex())
                try:
                    client.delete(ns, key)
                    counts["deleted"] += 1
                except KVFabricError as exc:
                    counts[f"delete_{exc.kind}"] += 1
                except Exception as exc:
                    _untyped(counts, exc)
        if chain_no % 16 == 0:
            events.emit("counts", counts=dict(counts))
    events.emit("counts", counts=dict(counts))
    for client in clients.values():
        client.close()


class KnownKeys:
    """Acknowledged, not deleted chunks of the writers' event files: key -> node."""

    def __init__(self, paths: list[str]) -> None:
        self._tails = [Tail(Path(p)) for p in paths]
        self.keys: dict[bytes, str] = {}
        self._order: list[bytes] = []

    def update(self) -> None:
        for tail in self._tails:
            for event in tail.read():
                if event["e"] == "ack":
                    key = bytes.fromhex(event["key"])
                    self.keys[key] = event["node"]
                    self._order.append(key)
                elif event["e"] == "del":
                    self.keys.pop(bytes.fromhex(event["key"]), None)

    def pick(self, rng: random.Random, *, audit: bool | None = None) -> tuple[bytes, str] | None:
        """A random known key (recent ones more often), of the audit kind asked for."""
        for _ in range(16):
            if not self._order:
                return None
            index = len(self._order) - 1 - min(int(rng.expovariate(1 / 64)), len(self._order) - 1)
            key = self._order[index]
            if key in self.keys and (audit is None or is_audit_key(key) == audit):
                return key, self.keys[key]
        return None


def scan_mapped(markers: dict[str, bytes]) -> Counter:
    """Pages that start with each tenant's marker, in every daemon arena this process maps
    (read through /proc/self/mem, so a mapping that is not readable counts nothing)."""
    found: Counter = Counter()
    wanted = {t: int.from_bytes(m, "little") for t, m in markers.items()}
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/memfd:kvfabric" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                regions.append((start, end))
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        for start, end in regions:
            try:
                data = os.pread(fd, end - start, start)
            except OSError:
                continue
            pages = len(data) // PAGE
            heads = np.frombuffer(data, dtype=np.uint8)[: pages * PAGE].reshape(pages, PAGE)
            words = heads[:, :MARKER_LEN].copy().view("<u8").ravel()
            for tenant, word in wanted.items():
                found[tenant] += int(np.count_nonzero(words == word))
    finally:
        os.close(fd)
    return found


def reader(cfg: dict[str, Any], workdir: Path, events: Events) -> None:
    tenant = cfg["tenant"]
    other = next(t for t in TENANTS if t != tenant)
    ns, other_ns = namespace(tenant), namespace(other)
    clients = {node: _client(sock, cfg["token"]) for node, sock in cfg["sockets"].items()}
    own, theirs = KnownKeys(cfg["own_logs"]), KnownKeys(cfg["other_logs"])
    rng = random.Random(cfg["seed"])
    counts: Counter = Counter()
    period, next_at, last_scan, last_counts = 1.0 / cfg["rate"], time.monotonic(), 0.0, 0.0
    while not stop_requested(workdir):
        next_at = _pace(next_at, period)
        own.update()
        picked = own.pick(rng, audit=False)
        if picked is not None:
            key, node = picked
            try:
                with clients[node].get(ns, key) as handle:
                    data = handle.to_bytes()
                verdict = verify(tenant, key, data)
                counts[f"read_{verdict}"] += 1
                if verdict != "ok":
                    events.emit("corrupt", node=node, tenant=tenant, key=key.hex(), how=verdict)
            except NotFoundError:
                counts["not_found"] += 1
            except KVFabricError as exc:
                counts[exc.kind] += 1
            except Exception as exc:
                _untyped(counts, exc)
        if rng.random() < cfg["cross_share"]:
            theirs.update()
            _cross_tenant(clients, theirs.pick(rng), ns, other_ns, other, counts, events)
        now = time.monotonic()
        if now - last_scan > cfg["scan_every_s"]:
            last_scan = now
            hits = scan_mapped({t: marker(t) for t in TENANTS})
            counts["scans"] += 1
            counts["scan_own_pages"] = max(counts["scan_own_pages"], hits[tenant])
            if hits[other]:
                counts["mapped_foreign_pages"] = max(counts["mapped_foreign_pages"], hits[other])
                events.emit("cross", how="mapped", pages=hits[other])
        if now - last_counts > 1.0:
            last_counts = now
            events.emit("counts", counts=dict(counts))
    events.emit("counts", counts=dict(counts))
    for client in clients.values():
        client.close()


def _cross_tenant(
    clients: dict[str, Client],
    picked: tuple[bytes, str] | None,
    ns: Any,
    other_ns: Any,
    other: str,
    counts: Counter,
    events: Events,
) -> None:
    """Another tenant's chunk through the API: its namespace must be refused, and its raw
    key in this tenant's own namespace must be a miss. Anything read is a cross-tenant read
    (and counted as such whatever its bytes)."""
    if picked is None:
        return
    key, node = picked
    for how, target, expected in (
        ("api_other_ns", other_ns, ForbiddenError),
        ("api_own_ns", ns, NotFoundError),
    ):
        counts[f"cross_tries_{how}"] += 1
        try:
            with clients[node].get(target, key) as handle:
                data = handle.to_bytes()
        except expected:
            counts[f"cross_refused_{how}"] += 1
            continue
        except KVFabricError as exc:
            counts[f"cross_{how}_{exc.kind}"] += 1
            continue
        except Exception as exc:
            _untyped(counts, exc)
            continue
        counts[f"cross_read_{how}"] += 1
        events.emit(
            "cross", how=how, node=node, key=key.hex(), their_bytes=verify(other, key, data) == "ok"
        )


def pinger(cfg: dict[str, Any], workdir: Path, events: Events) -> None:
    """One line per round trip: ``monotonic_start latency_ms ok``."""
    client = _client(cfg["socket"], cfg["token"], timeout=cfg.get("timeout", 10.0))
    with open(workdir / f"{cfg['name']}.pings", "a") as out:
        last_flush = time.monotonic()
        while not stop_requested(workdir):
            start = time.monotonic()
            ok = 1
            try:
                client.ping()
            except KVFabricError:
                ok = 0
            except Exception as exc:
                ok = 0
                _untyped(Counter(), exc)
            out.write(f"{start:.6f} {(time.monotonic() - start) * 1e3:.3f} {ok}\n")
            if start - last_flush > 0.5:
                out.flush()
                last_flush = start
            time.sleep(cfg["interval_s"])
    client.close()


def connector(cfg: dict[str, Any], workdir: Path, events: Events) -> None:
    """One line per new session: ``monotonic_start seconds ok kind``."""
    with open(workdir / f"{cfg['name']}.sessions", "a", buffering=1) as out:
        while not stop_requested(workdir):
            start, kind = time.monotonic(), "ok"
            try:
                with Client(
                    cfg["socket"], token=cfg["token"], timeout=cfg["timeout"], reconnect=False
                ) as client:
                    client.ping()
            except KVFabricError as exc:
                kind = exc.kind
            except Exception as exc:
                kind = f"untyped:{type(exc).__name__}"
            out.write(f"{start:.6f} {time.monotonic() - start:.4f} {int(kind == 'ok')} {kind}\n")
            time.sleep(cfg["interval_s"])


def frozen(cfg: dict[str, Any], workdir: Path, events: Events) -> None:
    _tenant, ns = cfg["tenant"], namespace(cfg["tenant"])
    client = _client(cfg["socket"], cfg["token"])
    key = bytes.fromhex(cfg["key"])
    writer_ = client.reserve(ns, key)
    views = [piece for layer in range(SPEC.num_layers) for piece in writer_.layer_pieces(layer)]
    events.emit("reserved", lease=writer_.lease, bytes=sum(v.nbytes for v in views))
    go = workdir / f"go-{cfg['name']}"
    while not go.exists():  # the harness stops this process here, past the lease
        time.sleep(0.02)
    fill = np.frombuffer(FROZEN_FILL * (CHUNK // len(FROZEN_FILL)), dtype=np.uint8)
    written = 0
    for view in views:  # what a writer that was stalled mid-copy does when it resumes
        flat = view.reshape(-1).view(np.uint8)
        flat[:] = fill[: flat.size]
        written += flat.size
    try:
        writer_.commit()
        outcome = "committed"
    except KVFabricError as exc:
        outcome = exc.kind
    events.emit("frozen_done", outcome=outcome, written=written)
    client.close()


ROLES = {
    "writer": writer,
    "reader": reader,
    "pinger": pinger,
    "connector": connector,
    "frozen": frozen,
    "flood": flood,
}


def main() -> None:
    role, config_path = sys.argv[1], Path(sys.argv[2])
    cfg = json.loads(config_path.read_text())
    workdir = Path(cfg["workdir"])
    if cfg.get("nice"):
        os.nice(cfg["nice"])
    events = Events(workdir / f"{cfg['name']}.jsonl")
    try:
        ROLES[role](cfg, workdir, events)
        events.emit("done")
    except BaseException as exc:
        events.emit("crashed", error=re.sub(r"\s+", " ", repr(exc))[:500])
        raise
    finally:
        events.close()


if __name__ == "__main__":
    main()
