"""A fixed set of named counters that any thread may add to.

The engine plugins count their traffic from several threads at once (vLLM's load threads and
model thread, SGLang's storage threads, LMCache's executor) and report it from another:
:class:`Counters` is the one lock-protected mapping they all use. The names are fixed at
creation, so a misspelt counter raises ``KeyError`` instead of starting a new series.
Readers get copies: :meth:`snapshot` (running totals) or :meth:`take` (this interval's
counts, then zero). The store does not use it: its counters change under the store's own
lock, together with the state they count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Generic, TypeVar

N = TypeVar("N", int, float)


class Counters(Generic[N]):
    """``Counters[int](names)``, or ``Counters[float]`` for counters of seconds."""

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._names = tuple(names)
        self._values: dict[str, N] = self._zeros()

    def add(self, **amounts: N) -> None:
        """Add to some counters at once (readers see all of these or none)."""
        with self._lock:
            unknown = amounts.keys() - self._values.keys()
            if unknown:
                raise KeyError(f"unknown counter(s) {sorted(unknown)}")
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, N]:
        """Every counter's value."""
        with self._lock:
            return dict(self._values)

    def take(self) -> dict[str, N]:
        """Every counter's value, then all are zero again (counts per interval)."""
        with self._lock:
            values, self._values = self._values, self._zeros()
        return values

    def _zeros(self) -> dict[str, N]:
        return dict.fromkeys(self._names, 0)
