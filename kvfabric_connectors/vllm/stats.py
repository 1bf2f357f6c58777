"""Connector counters, reported to vLLM so its own logs and metrics show fabric traffic.

Workers collect :class:`TransferCounters` and hand a snapshot to vLLM each step
(``get_kv_connector_stats``); vLLM aggregates the snapshots of all workers and intervals
with :meth:`KVFabricConnectorStats.aggregate` and logs :meth:`~KVFabricConnectorStats.reduce`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "loaded_tokens",
    "loaded_chunks",
    "load_errors",
    "load_seconds",
    "background_loads",
    "saved_tokens",
    "saved_chunks",
    "save_errors",
    "save_seconds",
    "pushed_chunks",
    "push_errors",
)


@dataclass
class KVFabricConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVFabricConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TransferCounters:
    """Thread-safe counters (the load thread and the model thread both count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}
        self._total: dict[str, float] = {}

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, value in amounts.items():
                assert name in COUNTERS, name
                self._data[name] = self._data.get(name, 0) + value
                self._total[name] = self._total.get(name, 0) + value

    def take(self) -> KVFabricConnectorStats | None:
        """This interval's counts (None when nothing happened); starts a new interval."""
        with self._lock:
            data, self._data = self._data, {}
        return KVFabricConnectorStats(data=data) if any(data.values()) else None

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._total)
