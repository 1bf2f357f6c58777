"""Memory and descriptors of the chaos harness's daemons, read from ``/proc``.

:class:`Monitor` samples each daemon's resident set and its open descriptors once a second.
The growth figure is of ``RssAnon`` (the daemon's heap: what a leak grows), not ``VmRSS``,
which also counts shared arena pages and mapped segment files that come and go with the
data. :func:`rss_slope_mb_per_hour` fits one slope to all of a node's incarnations at once
(each incarnation its own intercept: a restarted daemon starts small again), after a warm-up
per incarnation. :func:`socket_fds` counts the descriptors that are not files under
the daemon's data directory (segment files come and go with the data; sockets, pipes,
memfds and eventfds should come back to where an idle daemon had them).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from chaos_procs import Daemon


@dataclass(frozen=True)
class Sample:
    t: float
    incarnation: int
    rss_mb: float  # VmRSS
    anon_mb: float  # RssAnon
    fds: int
    cpu_s: float  # CPU seconds used so far (user + system)


def socket_fds(daemon: Daemon) -> Counter:
    """Descriptors of the daemon that are not files under its data directory, by kind
    (``socket``, ``pipe``, ``anon_inode:[eventfd]``, ``/memfd:...``, other paths)."""
    assert daemon.child is not None
    root = str(daemon.data_dir)
    kinds: Counter = Counter()
    for target in daemon.child.fd_targets():
        if not target.startswith(root):
            kinds[target.split(":[")[0] if ":[" in target else target] += 1
    return kinds


class Monitor(threading.Thread):
    def __init__(self, daemons: dict[str, Daemon], period_s: float = 1.0) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.daemons, self.period_s = daemons, period_s
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        for name, daemon in self.daemons.items():
            child = daemon.child
            if child is None or not daemon.ready or not child.alive:
                continue
            memory, cpu = child.memory_mb(), child.cpu_s()
            if "VmRSS" in memory and cpu is not None:
                self.samples[name].append(
                    Sample(
                        time.monotonic(),
                        daemon.incarnation,
                        memory["VmRSS"],
                        memory.get("RssAnon", 0.0),
                        sum(socket_fds(daemon).values()),
                        cpu,
                    )
                )

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def dump(self) -> list[dict[str, object]]:
        return [
            {"node": node, **vars(sample)}
            for node, samples in self.samples.items()
            for sample in samples
        ]

    def cpu_share(self, node: str, t0: float, t1: float) -> float | None:
        """Share of one core the node's daemon used between ``t0`` and ``t1`` (one
        incarnation: the samples nearest the ends)."""
        inside = [s for s in self.samples[node] if t0 <= s.t <= t1]
        if len(inside) < 2 or inside[0].incarnation != inside[-1].incarnation:
            return None
        return (inside[-1].cpu_s - inside[0].cpu_s) / (inside[-1].t - inside[0].t)

    def peak_rss_mb(self) -> float:
        return max((s.rss_mb for samples in self.samples.values() for s in samples), default=0.0)


def rss_slope_mb_per_hour(samples: list[Sample], warmup_s: float) -> float | None:
    """Least-squares slope of ``RssAnon`` over time, pooled over incarnations (each centred
    on its own means), ignoring each incarnation's first ``warmup_s``; None without two
    points."""
    by_life: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_life[sample.incarnation].append(sample)
    num = den = 0.0
    for life in by_life.values():
        start = life[0].t
        kept = [s for s in life if s.t - start >= warmup_s]
        if len(kept) < 2:
            continue
        t_mean = sum(s.t for s in kept) / len(kept)
        r_mean = sum(s.anon_mb for s in kept) / len(kept)
        num += sum((s.t - t_mean) * (s.anon_mb - r_mean) for s in kept)
        den += sum((s.t - t_mean) ** 2 for s in kept)
    return None if den == 0 else num / den * 3600
