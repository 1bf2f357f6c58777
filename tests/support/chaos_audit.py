"""The chaos harness's auditor: no acknowledged chunk that reached the SSD tier may vanish
unless an SSD eviction was counted.

* :class:`EvictionLedger` -- per node, the SSD tier's eviction count summed over the node's
  incarnations (a kill -9 restarts the daemon's counters at 0: the harness reads the count
  right before each kill, :meth:`EvictionLedger.before_kill`, and adds it to the next
  incarnation's, :meth:`EvictionLedger.restarted`).
* :class:`Auditor` -- a thread with an admin client per node. It follows the writers' event
  files; each acknowledged *audit key* (:func:`chaos_common.is_audit_key`: no reader reads
  it, so nothing promotes it out of the SSD tier) is looked up until the node reports it in
  the SSD tier, then it is *SSD-known*, stamped with the ledger's count. Every tick it asks
  each node whether it still holds its SSD-known chunks (``contains``, batched); a missing
  one is **lost** unless the ledger counted an SSD eviction since the stamp (then it is
  *excused*), or its writer deleted it (``del`` events come before the delete).

Callers that restart a node hold :attr:`Auditor.node_locks` ``[node]`` from the kill until
the ledger knows of the restart, so no verdict reads a new incarnation's counters against
the old one's stamp (and release it before :meth:`Auditor.verify_node`: lock order is the
auditor's lock, then a node's).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos_common import Tail, is_audit_key, namespace

from kvfabric.client import Client
from kvfabric.errors import KVFabricError

LOOKUPS_PER_TICK = 96
PENDING_TIMEOUT_S = 60.0  # an audit key not seen on SSD by then is not followed any more


class EvictionLedger:
    def __init__(self, stats_of: Callable[[str], dict[str, Any]]) -> None:
        self._stats_of = stats_of
        self._base: dict[str, int] = defaultdict(int)
        self._current: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    @staticmethod
    def ssd_evictions(stats: dict[str, Any]) -> int:
        return sum(int(t["evictions"]) for t in stats["tiers"] if t["kind"] == "ssd")

    def poll(self, node: str) -> int:
        """Read the node's count now; the running total (raises if the node is down)."""
        count = self.ssd_evictions(self._stats_of(node))
        with self._lock:
            self._current[node] = count
            return self._base[node] + count

    def total(self, node: str) -> int:
        with self._lock:
            return self._base[node] + self._current[node]

    def before_kill(self, node: str) -> None:
        try:
            self.poll(node)
        except Exception:
            pass

    def restarted(self, node: str) -> None:
        with self._lock:
            self._base[node] += self._current[node]
            self._current[node] = 0


class Auditor(threading.Thread):
    def __init__(
        self,
        sockets: dict[str, str],
        admin_token: str,
        logs: list[Path],
        ledger: EvictionLedger,
        tick_s: float = 0.5,
    ) -> None:
        super().__init__(name="chaos-auditor", daemon=True)
        self.sockets, self.admin_token, self.ledger, self.tick_s = (
            sockets,
            admin_token,
            ledger,
            tick_s,
        )
        self._tails = [Tail(p) for p in logs]
        self.node_locks = {node: threading.RLock() for node in sockets}
        self._clients: dict[str, Client] = {}
        self._halt = threading.Event()
        self._lock = threading.Lock()
        # key -> (node, tenant, acked at)
        self.pending: dict[bytes, tuple[str, str, float]] = {}
        # key -> (node, tenant, ledger total when seen on SSD)
        self.ssd_known: dict[bytes, tuple[str, str, int]] = {}
        self.deleted: set[bytes] = set()
        self.lost: list[dict[str, Any]] = []
        self.excused = 0
        self.ever_ssd_known = 0
        self.errors: dict[str, int] = defaultdict(int)

    def add_log(self, path: Path) -> None:
        with self._lock:
            self._tails.append(Tail(path))

    def client(self, node: str) -> Client:
        if node not in self._clients:
            self._clients[node] = Client(
                self.sockets[node], token=self.admin_token, timeout=5.0, reconnect_timeout=5.0
            )
        return self._clients[node]

    def run(self) -> None:
        while not self._halt.wait(self.tick_s):
            self.tick()

    def tick(self) -> None:
        with self._lock:
            self._follow()
            for node in self.sockets:
                with self.node_locks[node]:
                    try:
                        self._classify(node)
                        self.check_node(node)
                    except KVFabricError as exc:  # down, stopped, restarting: next tick
                        self.errors[exc.kind] += 1

    def _follow(self) -> None:
        for tail in self._tails:
            for event in tail.read():
                if event["e"] not in ("ack", "del"):
                    continue
                key = bytes.fromhex(event["key"])
                if event["e"] == "del":
                    self.deleted.add(key)
                    self.pending.pop(key, None)
                    self.ssd_known.pop(key, None)
                elif is_audit_key(key) and key not in self.deleted:
                    self.pending[key] = (event["node"], event["tenant"], event["t"])

    def _classify(self, node: str) -> None:
        now, done = time.monotonic(), 0
        for key, (where, tenant, acked) in list(self.pending.items()):
            if where != node:
                continue
            if now - acked > PENDING_TIMEOUT_S:
                del self.pending[key]
                continue
            if done >= LOOKUPS_PER_TICK:
                break
            done += 1
            hit = self.client(node).lookup(namespace(tenant), keys=[key])
            if hit.tier_tokens.get("ssd"):
                del self.pending[key]
                self.ssd_known[key] = (node, tenant, self.ledger.total(node))
                self.ever_ssd_known += 1
            elif hit.matched_chunks == 0:
                del self.pending[key]  # gone before reaching SSD (DRAM lost or evicted)

    def verify_node(self, node: str) -> int:
        """From another thread (not holding a node lock): :meth:`check_node` now."""
        with self._lock, self.node_locks[node]:
            self._follow()
            return self.check_node(node)

    def check_node(self, node: str) -> int:
        """Ask ``node`` for its SSD-known chunks now; the number found lost."""
        lost_before = len(self.lost)
        by_tenant: dict[str, list[bytes]] = defaultdict(list)
        for key, (where, tenant, _) in self.ssd_known.items():
            if where == node:
                by_tenant[tenant].append(key)
        for tenant, keys in by_tenant.items():
            for i in range(0, len(keys), 512):
                batch = keys[i : i + 512]
                present = self.client(node).contains(namespace(tenant), batch)
                missing = [k for k, there in zip(batch, present) if not there]
                if missing:
                    self._judge(node, missing)
        return len(self.lost) - lost_before

    def _judge(self, node: str, missing: list[bytes]) -> None:
        # A writer logs a delete before sending it: whatever was deleted by the time the
        # node said "missing" is in the event files now.
        self._follow()
        total = self.ledger.poll(node)
        for key in missing:
            if key in self.deleted:
                continue
            _, tenant, stamp = self.ssd_known.pop(key)
            if total > stamp:
                self.excused += 1
            else:
                self.lost.append(
                    {
                        "node": node,
                        "tenant": tenant,
                        "key": key.hex(),
                        "t": time.monotonic(),
                        "ssd_evictions": total,
                    }
                )

    def finish(self) -> None:
        """Stop the thread, then one last pass over every node (callers: workers stopped)."""
        self._halt.set()
        self.join(30)
        for _ in range(3):  # what the last puts left pending gets one more look
            self.tick()
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def summary(self) -> dict[str, Any]:
        return {
            "ssd_known_total": self.ever_ssd_known,
            "ssd_known_at_end": len(self.ssd_known),
            "lost": len(self.lost),
            "lost_samples": self.lost[:10],
            "excused_by_counted_evictions": self.excused,
            "errors": dict(self.errors),
        }
