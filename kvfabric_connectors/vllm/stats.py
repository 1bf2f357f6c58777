"""Connector counters, reported to vLLM so its own logs and metrics show fabric traffic.

Workers collect :class:`TransferCounters` and hand a snapshot to vLLM each step
(``get_kv_connector_stats``); vLLM aggregates the snapshots of all workers and intervals
with :meth:`KVFabricConnectorStats.aggregate` and logs :meth:`~KVFabricConnectorStats.reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvfabric.counters import Counters

COUNTERS = (
    "loaded_tokens",
    "loaded_chunks",
    "load_errors",
    "load_seconds",
    "background_loads",
    "saved_tokens",
    "saved_chunks",
    "save_errors",
    "save_skipped_chunks",
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
        self._interval = Counters[float](COUNTERS)
        self._total = Counters[float](COUNTERS)

    def add(self, **amounts: float) -> None:
        self._interval.add(**amounts)
        self._total.add(**amounts)

    def take(self) -> KVFabricConnectorStats | None:
        """This interval's counts, those that moved (None when nothing happened); starts
        a new interval."""
        data = {name: value for name, value in self._interval.take().items() if value}
        return KVFabricConnectorStats(data=data) if data else None

    def totals(self) -> dict[str, float]:
        return self._total.snapshot()
