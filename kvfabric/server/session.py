"""One client connection's state: identity, tenant, namespace cache and leases.

A session owns every lease (reservation or pin) taken through it. When the connection ends,
for any reason, :meth:`Session.close` aborts its unfinished writes and releases its pins, so
a client that dies never holds pages; a client that stalls loses them at the lease deadline
(enforced by the store). Lease ids are per session: one session can never name another's.

A reservation that expired is quarantined by the store (its pages are used by nothing) until
its writer lets go, and a session lets go only when it ends: the client process may be
frozen mid-copy and resume writing into those pages any time before that. Forgetting such a
lease (the client's abort, a failed commit) keeps it here, counted against the session's
lease limit, until :meth:`Session.close`.

A session that said in hello it only reads (``read_only``) gets read-only descriptors of its
arenas and may not reserve.

Sessions are used from the event loop and from executor threads (blocking handlers): the
lease table is guarded by a lock.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import msgpack

from kvfabric.errors import ForbiddenError, ProtocolError, UnavailableError
from kvfabric.logfmt import add_context
from kvfabric.protocol.messages import decode_namespace
from kvfabric.spec import Namespace
from kvfabric.store.handles import ObjectReader, ObjectWriter

Lease = ObjectWriter | ObjectReader
_MAX_CACHED_NAMESPACES = 256


class Session:
    """State of one control connection."""

    _ids = itertools.count(1)

    def __init__(self, *, local: bool, max_leases: int) -> None:
        self.id = next(self._ids)
        self.local = local  # Unix socket: may map shared memory and take leases
        self.authenticated = False
        self.tenant: str | None = None  # None: any tenant (admin, or auth off)
        self.read_only = False
        self.client = ""
        self._max_leases = max_leases
        self._leases: dict[int, Lease] = {}
        self._quarantined: list[ObjectWriter] = []  # expired writes forgotten by the client
        self._lease_ids = itertools.count(1)
        self._namespaces: dict[bytes, Namespace] = {}
        self._lock = threading.Lock()
        self.closed = False

    def authenticate(self, tenant: str | None, client: str, *, read_only: bool = False) -> None:
        self.authenticated = True
        self.tenant = tenant
        self.client = client
        self.read_only = read_only

    def namespace(self, raw: Any) -> Namespace:
        """Decode (cached) and check that this session may use the namespace."""
        # The cache key is the namespace's exact encoding: any other field, type (4.0, True)
        # or key goes through full validation again.
        cache_key = msgpack.packb(raw, use_bin_type=True)
        ns = self._namespaces.get(cache_key)
        if ns is None:
            ns = decode_namespace(raw)
            if len(self._namespaces) < _MAX_CACHED_NAMESPACES:
                self._namespaces[cache_key] = ns
        # the request's log lines name it (kvfabric.logfmt), and its tenant where the
        # session's token has none (the admin, or auth off)
        tenant = ns.tenant_salt if self.tenant is None and ns.tenant_salt else None
        add_context(namespace=ns.model_id, tenant=tenant)
        if self.tenant is not None and ns.tenant_salt != self.tenant:
            raise ForbiddenError(
                f"this session's token is for tenant {self.tenant!r}, not {ns.tenant_salt!r}"
            )
        return ns

    def add_lease(self, lease: Lease) -> int:
        with self._lock:
            if self.closed:
                _give_back(lease)
                raise UnavailableError("the session closed while the request was running")
            if len(self._leases) + len(self._quarantined) >= self._max_leases:
                _give_back(lease)
                raise ProtocolError(
                    f"too many open leases (limit {self._max_leases}); release some first"
                )
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = lease
            return lease_id

    def writer(self, lease_id: int) -> ObjectWriter:
        return self._typed(lease_id, ObjectWriter)  # type: ignore[return-value]

    def reader(self, lease_id: int) -> ObjectReader:
        return self._typed(lease_id, ObjectReader)  # type: ignore[return-value]

    def forget(self, lease_id: int) -> Lease:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if isinstance(lease, ObjectWriter) and lease.expired:
                self._quarantined.append(lease)  # its pages wait for the session's end
        if lease is None:
            raise ProtocolError(f"unknown lease {lease_id} (never taken, or already released)")
        return lease

    def _typed(self, lease_id: int, cls: type) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or not isinstance(lease, cls):
            raise ProtocolError(
                f"unknown {'write' if cls is ObjectWriter else 'read'} lease {lease_id}"
            )
        return lease

    @property
    def lease_count(self) -> int:
        return len(self._leases) + len(self._quarantined)

    def close(self) -> int:
        """Abort unfinished writes, release pins, end quarantines; returns how many leases
        were open."""
        with self._lock:
            self.closed = True
            leases, self._leases = list(self._leases.values()), {}
            quarantined, self._quarantined = self._quarantined, []
        for lease in leases + quarantined:
            _give_back(lease)
        return len(leases) + len(quarantined)


def _give_back(lease: Lease) -> None:
    if isinstance(lease, ObjectWriter):
        lease.close()  # an expired one's quarantined pages too: this session is over
    else:
        lease.release()
