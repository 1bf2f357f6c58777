"""Redis server counters and per-operation statistics for :mod:`kvfabric.planning.opcosts`.

Who calls: :func:`kvfabric.planning.opcosts.measure_opcosts` and
:mod:`kvfabric.planning.opcosts_events`. :class:`ServerCounters` reads one server's counters as
deltas over a block of work; :func:`per_op` and :func:`interleaved` run parts of a workload
under them and divide by the operations each part reports.

Each cost is the least per operation over several parts (lookups: interleaved rounds): a
shared or virtual host's steal and neighbours only ever add to a measurement.

Units as in :class:`~kvfabric.planning.scale_inputs.OpCosts`: Redis main-thread CPU seconds
from ``INFO cpu``, the calling thread's CPU seconds from ``time.thread_time``, wall seconds
from ``time.perf_counter``, memory from ``MEMORY USAGE ... SAMPLES 0``, network from ``INFO
stats`` byte counters (the ``INFO`` calls' own replies are calibrated out); per-command
execution time from ``INFO commandstats``. Errors: the client's ``redis.exceptions.RedisError``
propagates (the caller turns it into :class:`~kvfabric.errors.UnavailableError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from kvfabric.planning.scale_inputs import LinearCost

T = TypeVar("T")


@dataclass(frozen=True)
class _Reading:
    cpu: float  # main-thread CPU seconds
    net_in: int
    net_out: int
    calls: dict[str, int]
    usec: dict[str, int]


@dataclass(frozen=True)
class _Delta:
    cpu: float
    net_in: float
    net_out: float
    calls: dict[str, int]
    usec: dict[str, int]


class ServerCounters:
    """The server's counters, read as deltas with the cost of reading them taken out."""

    def __init__(self, client: redis.Redis) -> None:
        self._r = client
        self._overhead = _Delta(0.0, 0.0, 0.0, {}, {})
        first = self._read()
        pairs = []
        for _ in range(5):  # two reads back to back: what one read itself costs
            second = self._read()
            pairs.append(self._diff(first, second))
            first = second
        self._overhead = _Delta(
            min(p.cpu for p in pairs),
            min(p.net_in for p in pairs),
            min(p.net_out for p in pairs),
            {},
            {},
        )

    def _read(self) -> _Reading:
        cpu = info(self._r, "cpu")
        stats = info(self._r, "stats")
        commands = info(self._r, "commandstats")
        return _Reading(
            float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"]),
            int(stats["total_net_input_bytes"]),
            int(stats["total_net_output_bytes"]),
            {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in commands.items()},
            {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in commands.items()},
        )

    def _diff(self, a: _Reading, b: _Reading) -> _Delta:
        o = self._overhead
        return _Delta(
            max(0.0, b.cpu - a.cpu - o.cpu),
            max(0.0, b.net_in - a.net_in - o.net_in),
            max(0.0, b.net_out - a.net_out - o.net_out),
            {k: v - a.calls.get(k, 0) for k, v in b.calls.items()},
            {k: v - a.usec.get(k, 0) for k, v in b.usec.items()},
        )

    @contextmanager
    def measure(self, out: list[_Delta]) -> Iterator[None]:
        """Append the counters' delta over the block to ``out``."""
        before = self._read()
        yield
        out.append(self._diff(before, self._read()))


@dataclass(frozen=True)
class PerOp:
    """One operation's cost: per-op figures are the smallest over the parts it was measured
    in (a shared VM's steal and neighbours only ever add), command counts are totals."""

    ops: int
    server_cpu: float  # Redis main-thread seconds
    cpu: float  # calling thread
    wall: float
    net_out: float
    calls: dict[str, int]
    usec: dict[str, int]

    def count(self, names: Sequence[str]) -> int:
        return sum(self.calls.get(n, 0) for n in names)

    def usec_per_call(self, name: str) -> float:
        return per(self.usec.get(name, 0) * 1e-6, self.calls.get(name, 0))


def per_op(server: ServerCounters, parts: Sequence[Callable[[], int]]) -> PerOp:
    """Run each part (it returns how many operations it did) under the counters."""
    return interleaved(server, {"": parts}, len(parts))[""]


def interleaved(
    server: ServerCounters, parts: dict[str, Sequence[Callable[[], int]]], rounds: int
) -> dict[str, PerOp]:
    """Round by round, one part of every operation in turn, so that a noisy spell of the
    host spoils one part of each rather than every part of one."""
    rows: dict[str, list[tuple[int, _Delta, float, float]]] = {name: [] for name in parts}
    for i in range(rounds):
        for name, fns in parts.items():
            if i >= len(fns):
                continue
            deltas: list[_Delta] = []
            with server.measure(deltas):
                cpu, wall = time.thread_time(), time.perf_counter()
                ops = fns[i]()
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            rows[name].append((ops, deltas[0], cpu, wall))
    return {name: _summary(r) for name, r in rows.items()}


def _summary(rows: list[tuple[int, _Delta, float, float]]) -> PerOp:
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for _, delta, _, _ in rows:
        for name, n in delta.calls.items():
            calls[name] = calls.get(name, 0) + n
        for name, n in delta.usec.items():
            usec[name] = usec.get(name, 0) + n
    done = [row for row in rows if row[0]]
    return PerOp(
        sum(row[0] for row in rows),
        min((d.cpu / n for n, d, _, _ in done), default=0.0),
        min((c / n for n, _, c, _ in done), default=0.0),
        min((w / n for n, _, _, w in done), default=0.0),
        min((d.net_out / n for n, d, _, _ in done), default=0.0),
        calls,
        usec,
    )


def thirds(items: Sequence[T]) -> list[Sequence[T]]:
    """Three parts (fewer when there are fewer items)."""
    step = max(1, -(-len(items) // 3))
    return [items[i : i + step] for i in range(0, len(items), step)]


def info(client: redis.Redis, section: str) -> dict[str, Any]:
    reply: dict[str, Any] = client.info(section)
    return reply


def memory_usage(client: redis.Redis, *keys: str) -> int:
    total = 0
    for key in keys:
        used = client.memory_usage(key, samples=0)
        total += int(used or 0)
    return total


def per(value: float, count: float) -> float:
    return value / count if count else 0.0


def fit_linear(
    full: float, one: float, small: float, chunks: int, live_big: int, live_small: int
) -> LinearCost:
    """base + per_chunk * chunks + per_live * live from three points: (chunks, live_big),
    (1, live_big), (chunks, live_small); noise never makes a term negative."""
    per_chunk = max(0.0, (full - one) / (chunks - 1))
    per_live = max(0.0, (full - small) / (live_big - live_small))
    base = max(0.0, small - per_chunk * chunks - per_live * live_small)
    return LinearCost(base, per_chunk, per_live)
