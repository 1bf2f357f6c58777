"""Tenants' bytes on the SSD tier, against their SSD quotas (``store.quotas.<tenant>.ssd``).

A configured tenant (:attr:`kvfabric.store.tenants.Tenancy.ssd_limits`) is charged the span
of every SSD record that holds one of its objects (header page and alignment included: what
the record takes of the tier's capacity), from the moment the record is queued for writing
until it is deleted or found dead:

* placement (:mod:`kvfabric.store.disk_moves`, :mod:`kvfabric.store.residency`) calls
  :meth:`SsdUsage.add` when it queues a demotion's record and :meth:`SsdUsage.remove` when
  the write fails, or the record is deleted (an evicted or deleted object, a dropped SSD
  copy, a record compaction found corrupt); a record that changes hands (an object read
  back keeps its record as a copy, compaction moves it) stays charged;
* recovery charges the records a restart finds (:meth:`DiskMoves.recover
  <kvfabric.store.disk_moves.DiskMoves.recover>`): a record's metadata names its namespace,
  and so its tenant salt, so the count survives restarts.

Dead bytes that compaction has not returned yet are nobody's: they count in the tier's
``used_bytes``, not a tenant's. Namespaces of other tenant salts (not configured) are not
counted. Placement enforces the quota (:meth:`DiskMoves.make_ssd_room
<kvfabric.store.disk_moves.DiskMoves.make_ssd_room>`): before a tenant's record is queued
its own SSD records go first, and its object is evicted from memory instead of demoted when
that cannot make room.

Not thread-safe: used under the store lock.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)


class SsdUsage:
    """Bytes of SSD records per configured tenant, and each one's quota (None: none)."""

    def __init__(self, limits: Mapping[str, int | None]) -> None:
        self._limits = dict(limits)
        self._used = dict.fromkeys(self._limits, 0)

    def add(self, tenant: str, nbytes: int) -> None:
        if tenant in self._used:
            self._used[tenant] += nbytes

    def remove(self, tenant: str, nbytes: int) -> None:
        if tenant in self._used:
            left = self._used[tenant] - nbytes
            if left < 0:  # a record released twice, or never charged: a bug, logged loudly
                log.error("SSD bytes of tenant %r would go negative (%d); kept at 0", tenant, left)
            self._used[tenant] = max(0, left)

    def used(self, tenant: str) -> int:
        return self._used.get(tenant, 0)

    def limit(self, tenant: str) -> int | None:
        return self._limits.get(tenant)

    def excess(self, tenant: str, nbytes: int) -> int:
        """Bytes by which ``nbytes`` more would pass ``tenant``'s quota (<= 0: they fit)."""
        limit = self._limits.get(tenant)
        return 0 if limit is None else self._used[tenant] + nbytes - limit

    def by_tenant(self) -> dict[str, int]:
        """Every configured tenant's bytes (0 included)."""
        return dict(self._used)
