"""Admission: a request waits in the tenants' fair queue until its plan has engines with room.

Each request arrives with its scheduling values (tenant, class, token budget) and what the
fabric holds of its prompt. :meth:`Admission.admit` plans it at once when nothing is queued
and engines have room (``running < max_running``), taking their slots; otherwise it joins
the :class:`~kvfabric.sched.fair_queue.FairQueue` (429 with a retry-after when its tenant's
queued budget is full) and waits. Whenever a slot frees or an engine comes up, the pump
plans the queue's head over the engines with room and hands it its plan; a head that no
engine with room can serve yet waits there (the queue's order is the fairness: nothing
overtakes it but a higher class).

Isolation: the queue's order alone makes a light tenant's request wait for a slot, i.e. for
the rest of a flooding tenant's running request, however little the light tenant uses. So
each engine keeps ``isolation_slots`` above its ``max_running``: when the head cannot be
served, a queued request (in the queue's order) may take one when its tenant is not
backlogged (no more requests waiting than ``isolation_slots``), another tenant holds slots
or waits, and its own holds fewer slots than its weighted share of every engine's
``max_running + isolation_slots`` (:meth:`FairQueue.under_share`). A flooding tenant is
backlogged and never gets them (nor does a tenant alone: there is nobody to be isolated
from); as its requests end, the engine falls back to ``max_running`` before the queue's head
is served again, so the extra slots cost the engine a few more sequences in its batch, not a
longer queue.

A request no healthy engine could ever serve (none prefills, none decodes) fails at once
(:class:`~kvfabric.sched.planner.NoEngineError`) instead of waiting for its deadline.
Cancelled waiters (a deadline, a client gone) are skipped when they reach the head.

Runs on the gateway's event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfabric.gateway.engines import EnginePool
from kvfabric.gateway.metrics import GatewayMetrics
from kvfabric.sched.fair_queue import FairQueue
from kvfabric.sched.model import Holdings, Request
from kvfabric.sched.planner import Plan, Policy, plan

RATE_WINDOW_S = 60.0


@dataclass
class _Waiter:
    holdings: Holdings
    arrived: float
    future: asyncio.Future[Plan]


class Admission:
    def __init__(
        self,
        pool: EnginePool,
        policy: Policy,
        weights: dict[str, float],
        max_queued_tokens: int,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        *,
        isolation_slots: int = 0,
    ) -> None:
        self._pool = pool
        self._isolation = isolation_slots
        self._policy = policy
        self._queue: FairQueue[_Waiter] = FairQueue(weights, max_queued_tokens)
        self._metrics = metrics
        self._clock = clock
        self._served: collections.deque[tuple[float, int]] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def policy(self) -> Policy:
        """The configured policy, with the hand-off's fixed cost as measured once known."""
        fixed = self._pool.throughput.handoff_s(self._policy.handoff_fixed_s)
        if fixed == self._policy.handoff_fixed_s:
            return self._policy
        return dataclasses.replace(self._policy, handoff_fixed_s=fixed)

    def plan_now(
        self, request: Request, holdings: Holdings, *, exclude: tuple[str, ...] = ()
    ) -> Plan:
        """The plan over every healthy engine, room or not (``/v1/plan``, retries)."""
        engines = self._pool.states(exclude=exclude, with_room=False)
        return plan(request, holdings, engines, self.policy())

    def replan(self, request: Request, holdings: Holdings, failed: str) -> Plan:
        """A retry's plan, without the engine that failed: served at once, its slots taken
        even past ``max_running`` (it already waited its turn)."""
        chosen = self.plan_now(request, holdings, exclude=(failed,))
        self._take(request, chosen)
        return chosen

    async def admit(self, request: Request, holdings: Holdings) -> Plan:
        """The request's plan once engines have room (their slots taken: the caller gives
        them back with :meth:`EnginePool.give_back`); QueueFull or NoEngineError at once."""
        self.plan_now(request, holdings)  # NoEngineError: nothing could ever serve it
        if not len(self._queue):
            ready = self._try_plan(request, holdings)
            if ready is not None:
                return ready
        future: asyncio.Future[Plan] = asyncio.get_running_loop().create_future()
        self._queue.push(request, _Waiter(holdings, self._clock(), future), self.service_rate())
        self._gauge(request.tenant)
        self.drain()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # planned as the deadline struck
                self._give_back(request, future.result())
            raise

    def record_served(self, tokens: int) -> None:
        now = self._clock()
        self._served.append((now, tokens))
        while self._served and self._served[0][0] < now - RATE_WINDOW_S:
            self._served.popleft()

    def service_rate(self) -> float:
        """Tokens per second served over the last minute (the retry-after's yardstick);
        before anything finished, the engines' prior prefill rates."""
        if len(self._served) >= 2:
            span = max(1.0, self._clock() - self._served[0][0])
            return sum(t for _, t in self._served) / span
        return sum(s.prefill_tps for s in self._pool.states(with_room=False)) or 1.0

    async def pump(self) -> None:
        """Hand queued requests their plans as room opens; runs until cancelled."""
        while True:
            await self._pool.changed.wait()
            self._pool.changed.clear()
            self.drain()

    def drain(self) -> None:
        """Serve the queue's head while engines have room, then the requests of tenants
        below their share into the isolation slots."""
        while (head := self._queue.peek()) is not None:
            request, waiter = head
            if waiter.future.done():  # cancelled while waiting
                self._queue.pop()
                self._gauge(request.tenant)
                continue
            ready = self._try_plan(request, waiter.holdings)
            if ready is None:
                break
            self._queue.pop()
            self._gauge(request.tenant)
            waiter.future.set_result(ready)
        if self._isolation and len(self._queue):
            self._isolate()

    def _isolate(self) -> None:
        # runs on every drain while the head is blocked (a flood): the tenants' sets once per
        # pass and again only after a dispatch, and no sorting of the queue when no waiting
        # tenant could take a slot
        capacity = self._pool.capacity(self._isolation)
        waiting = self._queue.backlogged(0)
        backlogged = self._queue.backlogged(self._isolation)
        if not waiting - backlogged:
            return
        for request, waiter in self._queue.ordered():
            tenant = request.tenant
            if (
                waiter.future.done()
                or tenant in backlogged
                or not (set(self._pool.held) | waiting) - {tenant}
                or not self._queue.under_share(tenant, self._pool.held, capacity)
            ):
                continue
            ready = self._try_plan(request, waiter.holdings, self._isolation)
            if ready is None:
                continue
            self._queue.remove(waiter)
            self._gauge(request.tenant)
            self._metrics.isolated.labels(self._metrics.tenant(request.tenant)).inc()
            waiter.future.set_result(ready)
            waiting = self._queue.backlogged(0)
            backlogged = self._queue.backlogged(self._isolation)

    def _try_plan(self, request: Request, holdings: Holdings, extra_slots: int = 0) -> Plan | None:
        engines = self._pool.states(extra_slots=extra_slots)
        try:
            chosen = plan(request, holdings, engines, self.policy())
        except ValueError:  # NoEngineError: none with room now
            return None
        self._take(request, chosen)
        return chosen

    def _take(self, request: Request, chosen: Plan) -> None:
        uncached = request.prompt_tokens - chosen.reused_tokens
        self._pool.take(chosen.prefill_engine, uncached, request.tenant)
        if chosen.decode_engine != chosen.prefill_engine:
            self._pool.take(chosen.decode_engine, 0, request.tenant)

    def _give_back(self, request: Request, chosen: Plan) -> None:
        self._pool.prefilled(chosen.prefill_engine, request.prompt_tokens - chosen.reused_tokens)
        self._pool.give_back(chosen.prefill_engine, request.tenant)
        if chosen.decode_engine != chosen.prefill_engine:
            self._pool.give_back(chosen.decode_engine, request.tenant)

    def _gauge(self, tenant: str) -> None:
        label = self._metrics.tenant(tenant)
        self._metrics.queue_depth.labels(label).set(self._queue.queued_requests(tenant))
