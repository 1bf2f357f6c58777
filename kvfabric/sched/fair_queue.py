"""Weighted fair queueing of tenants by token budget, with priority classes and admission.

Each request costs its token budget (prompt plus longest output: a long prompt counts more
than a short one, a request count would not). Start-time fair queueing: a request of tenant
``t`` gets the virtual start ``max(V, finish[t])`` and finish ``start + cost / weight[t]``;
the queue serves the smallest virtual start first (ties: arrival order), and ``V`` is the
start of what was served last. Over any busy period the tokens served to two backlogged
tenants are in the ratio of their weights, within one request's cost each.

Priority classes are strict: every queued interactive request is served before any batch
one; each class keeps its own virtual clock. Admission: a tenant's queued budget is bounded
(``max_queued_tokens`` per tenant); a request that does not fit is refused with a
retry-after: the time the queue ahead of it needs at the observed service rate.

Isolation (:meth:`FairQueue.backlogged`, :meth:`FairQueue.under_share`): the queue's order
decides who gets a slot that frees, but a tenant that is not backlogged while others are
waiting or served, and holds fewer slots than its weighted share of the engines' capacity,
may be served out of order (:meth:`ordered`, :meth:`remove`) into slots kept above the
engines' normal limit, so a light tenant does not wait for a flooding one's requests to
finish. Served so, a request is still charged (its finish tag stays the tenant's), and the
virtual clock does not move: what the queue's order hands out is unchanged.

Not thread-safe: the owner (a gateway's event loop) serialises calls. No clock is read:
the caller passes the service rate it measured.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvfabric.sched.model import Priority, Request

T = TypeVar("T")
DEFAULT_WEIGHT = 1.0


class QueueFull(Exception):
    """A tenant's queue cannot take the request; ``retry_after_s`` says when to ask again."""

    def __init__(self, tenant: str, retry_after_s: float) -> None:
        super().__init__(f"tenant {tenant!r}: queue full, retry after {retry_after_s:.1f} s")
        self.tenant = tenant
        self.retry_after_s = retry_after_s


@dataclass(order=True)
class _Entry(Generic[T]):
    start: float
    seq: int
    finish: float = field(compare=False)
    request: Request = field(compare=False)
    item: T = field(compare=False)


@dataclass
class _Class(Generic[T]):
    heap: list[_Entry[T]] = field(default_factory=list)
    clock: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)


class FairQueue(Generic[T]):
    """Tenants' requests (each with an ``item`` the caller serves) in fair order."""

    def __init__(self, weights: Mapping[str, float], max_queued_tokens: int) -> None:
        if any(w <= 0 for w in weights.values()):
            raise ValueError("tenant weights must be positive")
        if max_queued_tokens <= 0:
            raise ValueError("max_queued_tokens must be positive")
        self._weights = dict(weights)
        self._max = max_queued_tokens
        self._classes: dict[Priority, _Class[T]] = {p: _Class() for p in Priority}
        self._queued: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self._seq = itertools.count()

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, DEFAULT_WEIGHT)

    def queued_tokens(self, tenant: str) -> int:
        return self._queued.get(tenant, 0)

    def queued_requests(self, tenant: str) -> int:
        return self._requests.get(tenant, 0)

    def __len__(self) -> int:
        return sum(len(c.heap) for c in self._classes.values())

    def push(self, request: Request, item: T, service_tokens_per_s: float) -> None:
        """Queue ``request``; QueueFull (with a retry-after from ``service_tokens_per_s``,
        the tokens per second the engines have been serving) when its tenant's queued
        budget would pass ``max_queued_tokens``."""
        tenant, cost = request.tenant, request.budget_tokens
        queued = self.queued_tokens(tenant)
        if queued + cost > self._max:
            ahead = sum(self._queued.values())
            raise QueueFull(tenant, ahead / max(service_tokens_per_s, 1e-9))
        cls = self._classes[request.priority]
        start = max(cls.clock, cls.finish.get(tenant, 0.0))
        finish = start + cost / self.weight(tenant)
        cls.finish[tenant] = finish
        heapq.heappush(cls.heap, _Entry(start, next(self._seq), finish, request, item))
        self._queued[tenant] = queued + cost
        self._requests[tenant] = self._requests.get(tenant, 0) + 1

    def peek(self) -> tuple[Request, T] | None:
        """What :meth:`pop` would return, left queued (a caller that cannot serve it yet)."""
        entry = self._head()
        return None if entry is None else (entry.request, entry.item)

    def ordered(self) -> list[tuple[Request, T]]:
        """Every queued request in the order :meth:`pop` would serve them (a snapshot)."""
        out: list[tuple[Request, T]] = []
        for priority in Priority:
            out += [(e.request, e.item) for e in sorted(self._classes[priority].heap)]
        return out

    def remove(self, item: T) -> Request:
        """Take ``item`` out of the queue wherever it stands (served out of order);
        KeyError when it is not queued."""
        for cls in self._classes.values():
            for i, entry in enumerate(cls.heap):
                if entry.item is item:
                    cls.heap[i] = cls.heap[-1]
                    cls.heap.pop()
                    heapq.heapify(cls.heap)
                    self._dequeued(entry.request)
                    return entry.request
        raise KeyError("not queued")

    def backlogged(self, limit: int) -> set[str]:
        """Tenants with more than ``limit`` requests waiting (0: every tenant waiting)."""
        return {t for t, n in self._requests.items() if n > limit}

    def under_share(self, tenant: str, held: Mapping[str, int], capacity: int) -> bool:
        """Whether ``tenant`` holds fewer than its weighted share of ``capacity`` slots,
        shared among the tenants with requests queued or held (``held``: slots per tenant)."""
        active = {t for t, n in held.items() if n > 0} | set(self._requests) | {tenant}
        total = sum(self.weight(t) for t in active)
        return held.get(tenant, 0) < capacity * self.weight(tenant) / total

    def pop(self) -> tuple[Request, T] | None:
        """The next request to serve (interactive first), or None when empty."""
        for priority in Priority:  # declaration order: interactive, then batch
            cls = self._classes[priority]
            if cls.heap:
                entry = heapq.heappop(cls.heap)
                cls.clock = entry.start
                self._dequeued(entry.request)
                return entry.request, entry.item
        return None

    def _dequeued(self, request: Request) -> None:
        tenant = request.tenant
        self._queued[tenant] -= request.budget_tokens
        self._requests[tenant] -= 1
        if not self._requests[tenant]:
            del self._requests[tenant], self._queued[tenant]

    def _head(self) -> _Entry[T] | None:
        for priority in Priority:
            heap = self._classes[priority].heap
            if heap:
                return heap[0]
        return None
