"""Backend counters, reported through SGLang's own ``StorageMetrics``.

SGLang's scheduler calls ``get_stats()`` each metrics interval and feeds the result to its
``StorageMetricsCollector`` (``sglang:prefetch_pgs``, ``sglang:backup_pgs``,
``sglang:prefetch_bandwidth``, ``sglang:backup_bandwidth`` histograms): one entry per batch
since the last call, bandwidth in GB/s of the call's wall time, as SGLang's own backends
report them. :class:`KVFabricStorageMetrics` is that type with kvfabric's cumulative
counters added (pages asked about and hit, pages and bytes read and written, pulls,
failures), so ``isinstance(stats, StorageMetrics)`` holds for SGLang's collector and
operators can read the fabric's traffic from the same object. Thread-safe.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sglang.srt.observability.metrics_collector import StorageMetrics

from kvfabric.counters import Counters

COUNTERS = (
    "queried_pages",
    "hit_pages",
    "pulled_pages",
    "read_pages",
    "read_bytes",
    "read_misses",
    "written_pages",
    "written_bytes",
    "already_stored_pages",
    "write_failures",
    "daemon_errors",
)
_GB = 1e9


@dataclass
class KVFabricStorageMetrics(StorageMetrics):
    """SGLang's per-interval lists plus totals since the backend started."""

    totals: dict[str, int] = field(default_factory=dict)


class StorageCounters:
    def __init__(self) -> None:
        self._totals = Counters[int](COUNTERS)
        self._lock = threading.Lock()  # the batches of this interval
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []

    def add(self, **amounts: int) -> None:
        self._totals.add(**amounts)

    def read_batch(self, pages: int, nbytes: int, seconds: float) -> None:
        """A get batch that loaded ``pages`` pages (``nbytes``) in ``seconds``."""
        with self._lock:
            self._prefetch_pgs.append(pages)
            self._prefetch_bandwidth.append(nbytes / _GB / max(seconds, 1e-9))

    def write_batch(self, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._backup_pgs.append(pages)
            self._backup_bandwidth.append(nbytes / _GB / max(seconds, 1e-9))

    def totals(self) -> dict[str, int]:
        return self._totals.snapshot()

    def take(self) -> KVFabricStorageMetrics:
        """This interval's batches and the running totals; starts a new interval."""
        with self._lock:
            metrics = KVFabricStorageMetrics(
                prefetch_pgs=self._prefetch_pgs,
                backup_pgs=self._backup_pgs,
                prefetch_bandwidth=self._prefetch_bandwidth,
                backup_bandwidth=self._backup_bandwidth,
                totals=self._totals.snapshot(),
            )
            self._prefetch_pgs, self._backup_pgs = [], []
            self._prefetch_bandwidth, self._backup_bandwidth = [], []
        return metrics
