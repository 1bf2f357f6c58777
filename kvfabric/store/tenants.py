"""Tenants' memory and limits: arenas of their own, quotas, and the arena ids clients see.

A **tenant** is a namespace ``tenant_salt`` the node was configured with: a tenant of the
daemon's tokens (``auth.tenants``) or one named in ``store.quotas``. Each gets, in every host
tier, a pool of its own (:meth:`kvfabric.tiers.base.PagedTier.add_pool`): a separate memfd
that holds that tenant's objects and nothing else, whoever put them (an admin writing into a
tenant's namespace writes into the tenant's arena). A local session of a tenant is handed its
tenant's arenas only (:meth:`Tenancy.arenas`); the admin gets every one. Arenas are made once,
when the store opens, so the set a session (or a peer's transport) sees never changes under
it; namespaces of any other tenant salt, and those without one, live in the default arenas.

**Arena ids** name an arena on the wire (placements, hello, peer transport regions): the
default arena of tier ``i`` has id ``i`` (what clients and peers of older daemons used), the
tenants' arenas follow, tenant by tenant (sorted), tier by tier.

**Quotas** (:class:`~kvfabric.store.config.Quota`, ``store.quotas``):

* bytes per memory tier: the tenant's pool in that tier is that large, so its objects never
  take more; a tenant at its quota makes room by demoting its own objects (and only its own),
  and gets :class:`~kvfabric.errors.QuotaExceededError` when none can move;
* bytes of the SSD tier (:attr:`Tenancy.ssd_limits`): counted and enforced by placement
  (:mod:`kvfabric.store.ssd_usage`); a tenant at its quota gives up its own SSD records;
* reservations in flight (:meth:`Tenancy.begin_write`), expired ones still quarantined
  included;
* namespaces holding data (:meth:`Tenancy.add_namespace`; :data:`DEFAULT_NAMESPACES` when
  the quota does not say), so no tenant fills the store's namespace table for the others; a
  namespace is forgotten when its last object goes, so reserving and aborting costs none.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvfabric.errors import ConfigError, QuotaExceededError
from kvfabric.memory.arena import SharedArena
from kvfabric.memory.pages import Pages
from kvfabric.spec import Namespace
from kvfabric.store.config import ANY_TENANT, Quota, StoreConfig
from kvfabric.store.index import LocalIndex
from kvfabric.tiers.base import PagedTier
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.host import HostTier

# SCM_RIGHTS passes at most 253 descriptors in one message: the admin gets every arena
MAX_ARENAS = 240


class _Every(enum.Enum):
    TENANT = "every tenant"


EVERY_TENANT: Final = _Every.TENANT  # arenas(): every arena (the admin's view)
EveryTenant = Literal[_Every.TENANT]
DEFAULT_NAMESPACES = 4096  # a tenant's namespaces when its quota does not say


@dataclass(frozen=True)
class ArenaInfo:
    """One shared-memory arena as local clients and peer transports name it."""

    arena_id: int
    tier_index: int
    tier_name: str
    tenant: str | None  # None: the default arena of the tier
    arena: SharedArena
    read_only_fd: int  # an O_RDONLY descriptor of it, for sessions that only read


class Tenancy:
    """The tenants' pools and arena ids over the store's tiers, and their quotas' counts."""

    def __init__(
        self,
        config: StoreConfig,
        tiers: Sequence[Any],
        names: Sequence[str],
        index: LocalIndex,
        tenants: Iterable[str],
    ) -> None:
        self._config = config
        named = {t for t in config.quotas if t != ANY_TENANT}
        self.tenants = sorted({t for t in tenants if t} | named)
        host = [i for i, tier in enumerate(tiers) if isinstance(tier, HostTier)]
        if len(host) * (1 + len(self.tenants)) > MAX_ARENAS:
            raise ConfigError(
                f"{len(self.tenants)} tenants with arenas of their own in "
                f"{len(host)} host tiers need more than {MAX_ARENAS} arenas"
            )
        self._quotas = {t: config.quota_for(t) for t in self.tenants}
        self._arenas: list[ArenaInfo] = []
        self._ids: dict[tuple[int, str | None], int] = {}
        # every configured tenant -> its bytes on the SSD tier (None: no SSD quota)
        self.ssd_limits: dict[str, int | None] = dict.fromkeys(self.tenants)
        for i in host:
            self._add(i, names[i], None, tiers[i].arena, i)
        next_id = len(tiers)
        for tenant in self.tenants:
            quota = self._quotas[tenant]
            for i, tier in enumerate(tiers):
                limit = None if quota is None else quota.tier_bytes(names[i], tier.capacity_bytes)
                if isinstance(tier, DiskTier):
                    self.ssd_limits[tenant] = limit
                    if limit is not None:
                        index.track_tenant(tenant)  # it makes room among its own records
                    continue
                if not isinstance(tier, HostTier):
                    if limit is not None and isinstance(tier, PagedTier):
                        raise ConfigError(
                            f"quotas.{tenant}.{names[i]}: a device tier has no "
                            f"tenant arenas, so no quota"
                        )
                    continue
                tier.add_pool(tenant, tier.capacity_bytes if limit is None else limit)
                self._add(i, names[i], tenant, tier.arenas[tenant], next_id)
                next_id += 1
                if limit is not None and limit < tier.capacity_bytes:
                    index.track_tenant(tenant)  # it will make room among its own objects
        self._writers: dict[str, int] = {}
        self._namespaces: dict[str, int] = {}

    def _add(
        self, tier_index: int, tier_name: str, tenant: str | None, arena: SharedArena, arena_id: int
    ) -> None:
        self._ids[(tier_index, tenant)] = arena_id
        self._arenas.append(
            ArenaInfo(arena_id, tier_index, tier_name, tenant, arena, arena.read_only_fd())
        )

    def arenas(self, tenant: str | EveryTenant | None = EVERY_TENANT) -> list[ArenaInfo]:
        """The arenas a session of ``tenant`` may map: its own (None: the default ones, a
        tenant salt without arenas of its own: none), or every one."""
        if tenant is EVERY_TENANT:
            return list(self._arenas)
        return [a for a in self._arenas if a.tenant == tenant]

    def arena_id(self, tier_index: int, pages: Any) -> int | None:
        """The id of the arena ``pages`` (a paged tier's handle) lie in; None: not a host
        arena (device memory, an SSD extent)."""
        pool = pages.pool if isinstance(pages, Pages) else None
        return self._ids.get((tier_index, pool))

    def close(self) -> None:
        """Close the read-only descriptors (the arenas close with their tiers)."""
        for info in self._arenas:
            try:
                os.close(info.read_only_fd)
            except OSError:
                pass
        self._arenas = []

    def quota(self, tenant: str) -> Quota | None:
        return self._quotas.get(tenant) if tenant else None

    # ------------------------------------------------------------------ counted limits

    def begin_write(self, tenant: str, check_only: bool = False) -> None:
        """Count a reservation of ``tenant``; QuotaExceededError when it is at its limit."""
        quota = self.quota(tenant)
        if quota is None or quota.reservations is None:
            return
        held = self._writers.get(tenant, 0)
        if held >= quota.reservations:
            raise QuotaExceededError(
                f"tenant {tenant!r} has {held} reservations in flight "
                f"(its quota); commit or abort some first"
            )
        if not check_only:
            self._writers[tenant] = held + 1

    def end_write(self, tenant: str) -> None:
        held = self._writers.get(tenant)
        if held is None:
            return
        if held > 1:
            self._writers[tenant] = held - 1
        else:
            del self._writers[tenant]

    def writes_in_flight(self, tenant: str) -> int:
        return self._writers.get(tenant, 0)

    def add_namespace(
        self, ns: Namespace, *, check_only: bool = False, force: bool = False
    ) -> None:
        """Count a namespace ``ns``'s tenant starts holding data in; QuotaExceededError at
        its limit (``force``: count it anyway, as a restart finding it on SSD does)."""
        tenant = ns.tenant_salt
        if tenant not in self._quotas:
            return  # not a configured tenant: the store's own table limit applies
        quota = self._quotas[tenant]
        limit = (
            DEFAULT_NAMESPACES if quota is None or quota.namespaces is None else quota.namespaces
        )
        held = self._namespaces.get(tenant, 0)
        if held >= limit and not force:
            raise QuotaExceededError(
                f"tenant {tenant!r} holds data in {held} namespaces (its "
                f"quota); a new one needs an old one emptied first"
            )
        if not check_only:
            self._namespaces[tenant] = held + 1

    def drop_namespace(self, ns: Namespace) -> None:
        tenant = ns.tenant_salt
        held = self._namespaces.get(tenant)
        if held is None:
            return
        if held > 1:
            self._namespaces[tenant] = held - 1
        else:
            del self._namespaces[tenant]
