"""The store's shared state: its tiers, index, counters and lock, owned in one place.

:class:`StoreState` is built by :class:`~kvfabric.store.store.TieredStore` and handed to the
parts that work on it: the store's API (:mod:`kvfabric.store.store`), the leases
(:mod:`kvfabric.store.leases`) and placement (:mod:`kvfabric.store.placement`,
:mod:`kvfabric.store.disk_moves`, :mod:`kvfabric.store.residency`). None of them owns what
is here, and none reaches into another's attributes: placement calls the store back only
through :class:`PlacementHooks`, and the store calls placement only through its methods.

Thread rules: every attribute is read and changed with ``lock`` held (re-entrant; ``cond``
is its condition), except :meth:`StoreState.disk` and the tier list, which never change
after construction. :meth:`StoreState.wait` releases the lock while it waits, so whoever
calls it re-checks what it was waiting for.

The nonblocking mode (:meth:`StoreState.nonblocking`, per thread): inside it,
:meth:`StoreState.wait` raises :class:`~kvfabric.errors.WouldBlockError` instead of waiting,
and so does every operation that would otherwise wait (for room, an SSD read, a layer).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvfabric.errors import ConfigError, DeadlineExceededError, WouldBlockError
from kvfabric.memory.copy import Piece
from kvfabric.spec import Namespace
from kvfabric.store.config import StoreConfig
from kvfabric.store.factory import AnyTier, build_tier
from kvfabric.store.index import Entry, LocalIndex
from kvfabric.store.stats import StoreCounters, TierCounters
from kvfabric.tiers.base import PagedTier
from kvfabric.tiers.disk import DiskTier

# complete objects that moved or left: (stored, with their new tier), (removed, old tier)
InventoryChange = Callable[[list[Entry], list[tuple[Entry, int]]], None]


@dataclass(frozen=True)
class PlacementHooks:
    """Placement's only ways back into the store; both are called with the lock held.

    ``reclaim``: expire stale leases now (a dead client's may be what holds the memory a
    put needs); returns how many expired. ``inventory_changed``: complete objects were
    stored, moved or removed (the store tells its inventory listeners; must not raise).
    """

    reclaim: Callable[[], int]
    inventory_changed: InventoryChange


class StoreState:
    """Tiers (fastest first), the index over them, the counters and the lock."""

    def __init__(
        self, config: StoreConfig, on_namespace_empty: Callable[[Namespace], None]
    ) -> None:
        """Create the data directory and the tiers (ConfigError if it cannot be created);
        ``on_namespace_empty`` is the index's callback (see :class:`LocalIndex`)."""
        data_dir = Path(config.data_dir)
        try:
            data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"data_dir {str(data_dir)!r} cannot be created: {exc}") from None
        self.names = [t.name for t in config.tiers]
        self.tiers: list[AnyTier] = []
        try:
            for tier_config in config.tiers:
                self.tiers.append(build_tier(tier_config, data_dir.resolve()))
        except BaseException:
            self.close_tiers()
            raise
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.index = LocalIndex(len(self.tiers), on_namespace_empty)
        self.tier_counters = [TierCounters() for _ in self.tiers]
        self.counters = StoreCounters()
        last = self.tiers[-1]
        self.disk_index = len(self.tiers) - 1 if isinstance(last, DiskTier) else None
        self.paged = [i for i, t in enumerate(self.tiers) if isinstance(t, PagedTier)]
        self.pending_demotion = [0] * len(self.tiers)  # bytes being written to SSD, per tier
        self._nonblocking = threading.local()  # .on: wait() raises WouldBlockError

    def disk(self) -> DiskTier | None:
        """The SSD tier (always the last one), if there is one (no lock needed)."""
        if self.disk_index is None:
            return None
        disk = self.tiers[self.disk_index]
        assert isinstance(disk, DiskTier)
        return disk

    @property
    def ssd_index(self) -> int:
        """The SSD tier's index, where the caller knows there is one."""
        assert self.disk_index is not None
        return self.disk_index

    def pieces(self, entry: Entry, offset: int, length: int) -> list[Piece]:
        """Views of bytes of an entry in a memory tier (lock held: the entry may move)."""
        tier = self.tiers[entry.tier]
        assert isinstance(tier, PagedTier)
        return tier.pieces(entry.handle, offset, length)

    # ------------------------------------------------------------------ waiting

    @contextlib.contextmanager
    def nonblocking(self) -> Iterator[None]:
        """This thread's nonblocking mode, for the block."""
        self._nonblocking.on = True
        try:
            yield
        finally:
            self._nonblocking.on = False

    @property
    def in_nonblocking_mode(self) -> bool:
        return bool(getattr(self._nonblocking, "on", False))

    def wait(self, deadline: float | None, what: str) -> None:
        """Wait on ``cond`` (lock held; it is released meanwhile) until notified, at most
        until ``deadline`` (DeadlineExceededError once it passed); WouldBlockError in the
        nonblocking mode."""
        if self.in_nonblocking_mode:
            raise WouldBlockError(what)
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceededError(f"timed out: {what}")
        self.cond.wait(remaining if remaining is not None else 1.0)

    # ------------------------------------------------------------------ lifecycle

    def close_tiers(self, *, keep: AnyTier | None = None) -> None:
        """Close every tier but ``keep`` (the SSD tier, closed by whoever flushes it)."""
        for tier in self.tiers:
            if tier is not keep:
                tier.close()
