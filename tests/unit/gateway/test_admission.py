"""Admission in front of the engines' slots: a request runs at once while engines have room,
waits in the tenants' fair queue when they do not, and is handed its plan (its engines'
slots taken) in the queue's order as slots free; a tenant below its share takes an isolation
slot past a flooding tenant's queue."""

from __future__ import annotations

import asyncio

import pytest

from kvfabric.gateway.admission import Admission
from kvfabric.gateway.config import ClassConfig, EngineConfig
from kvfabric.gateway.engines import EnginePool
from kvfabric.gateway.metrics import GatewayMetrics
from kvfabric.sched.fair_queue import QueueFull
from kvfabric.sched.model import HardwareProfile, Holdings, Link, Priority, Request
from kvfabric.sched.planner import NoEngineError, Policy

CLASSES = {"gpu": ClassConfig(10_000, 50, 1.0)}
POLICY = Policy({"gpu": HardwareProfile("gpu", 1.0)}, Link(1e9, 1024))


def make(
    max_running: int = 1, max_queued: int = 10_000, isolation_slots: int = 0
) -> tuple[EnginePool, Admission]:
    metrics = GatewayMetrics()
    engine = EngineConfig("e", "http://127.0.0.1:9", "gpu", max_running=max_running)
    pool = EnginePool([engine], CLASSES, metrics)
    pool.mark("e", True)
    weights = {"heavy": 3.0}
    admission = Admission(
        pool, POLICY, weights, max_queued, metrics, isolation_slots=isolation_slots
    )
    return pool, admission


async def finish(pool: EnginePool, admission: Admission, tenant: str | None = None) -> None:
    """A request of ``tenant`` (by default: the one tenant holding slots) ended: its slot
    back, the queue served."""
    pool.give_back("e", tenant or next(iter(pool.held)))
    admission.drain()
    await asyncio.sleep(0)


def test_a_request_runs_at_once_while_its_engine_has_room() -> None:
    async def scenario() -> None:
        pool, admission = make(max_running=2)
        await admission.admit(Request("t", 100, 10), Holdings())
        await admission.admit(Request("t", 100, 10), Holdings())
        assert pool["e"].running == 2 and pool["e"].queued_tokens == 200 and not len(admission)

    asyncio.run(scenario())


def test_queued_requests_are_served_interactive_first_then_by_weight() -> None:
    async def scenario() -> None:
        pool, admission = make()
        await admission.admit(Request("heavy", 100, 0), Holdings())  # takes the one slot
        order: list[str] = []

        async def ask(name: str, request: Request) -> None:
            await admission.admit(request, Holdings())
            order.append(name)

        batch = Priority.BATCH
        tasks = [
            asyncio.create_task(ask(f"heavy{i}", Request("heavy", 100, 0, batch))) for i in range(3)
        ]
        tasks += [
            asyncio.create_task(ask(f"light{i}", Request("light", 100, 0, batch))) for i in range(3)
        ]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(ask("urgent", Request("light", 100, 0))))
        await asyncio.sleep(0)
        assert len(admission) == 7 and order == []
        for _ in range(7):
            await finish(pool, admission)
        await asyncio.gather(*tasks)
        assert order[0] == "urgent"
        # weight 3 against 1: the heavy tenant's three before the light one's second
        assert order.index("heavy2") < order.index("light1")
        assert pool["e"].running == 1  # exactly one request holds the slot at a time

    asyncio.run(scenario())


def test_a_waiter_whose_deadline_passed_is_skipped_and_gives_nothing_away() -> None:
    async def scenario() -> None:
        pool, admission = make()
        await admission.admit(Request("t", 100, 0), Holdings())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await admission.admit(Request("t", 100, 0), Holdings())
        later = asyncio.create_task(admission.admit(Request("t", 50, 0), Holdings()))
        await asyncio.sleep(0)
        await finish(pool, admission)
        chosen = await later
        assert chosen.prefill_engine == "e" and pool["e"].running == 1
        assert pool["e"].queued_tokens == 100 + 50  # the skipped one never took the slot

    asyncio.run(scenario())


def test_a_full_tenant_queue_refuses_with_a_retry_after() -> None:
    async def scenario() -> None:
        _, admission = make(max_queued=250)
        await admission.admit(Request("t", 100, 0), Holdings())
        waiting = [
            asyncio.create_task(admission.admit(Request("t", 100, 0), Holdings())) for _ in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as full:
            await admission.admit(Request("t", 100, 0), Holdings())
        assert full.value.retry_after_s > 0
        other = asyncio.create_task(admission.admit(Request("other", 100, 0), Holdings()))
        await asyncio.sleep(0)
        assert len(admission) == 3  # the limit is the tenant's: another one still queues
        waiting.append(other)
        for task in waiting:
            task.cancel()

    asyncio.run(scenario())


def test_a_request_no_healthy_engine_could_serve_fails_at_once() -> None:
    async def scenario() -> None:
        pool, admission = make()
        pool.mark("e", False)
        with pytest.raises(NoEngineError):
            await admission.admit(Request("t", 100, 0), Holdings())

    asyncio.run(scenario())


def test_a_light_tenant_takes_isolation_slots_past_a_flood_up_to_its_share() -> None:
    async def scenario() -> None:
        pool, admission = make(max_running=2, isolation_slots=2)
        for _ in range(2):
            await admission.admit(Request("flood", 100, 0), Holdings())
        flood = [
            asyncio.create_task(admission.admit(Request("flood", 100, 0), Holdings()))
            for _ in range(4)
        ]
        await asyncio.sleep(0)
        assert len(admission) == 4 and pool["e"].running == 2  # the flood waits its turn
        # light holds fewer than its half of 2 + 2 slots: it goes past the flood's queue
        await admission.admit(Request("light", 100, 0), Holdings())
        await admission.admit(Request("light", 100, 0), Holdings())
        assert pool["e"].running == 4 and pool.held == {"flood": 2, "light": 2}
        third = asyncio.create_task(admission.admit(Request("light", 100, 0), Holdings()))
        await asyncio.sleep(0)
        assert not third.done() and len(admission) == 5  # at its share: it queues
        # flood requests end: the flood is backlogged (more waiting than isolation slots),
        # so it takes none, and the engine falls back to max_running before its head runs
        await finish(pool, admission, "flood")
        await finish(pool, admission, "flood")
        assert pool["e"].running == 2 and len(admission) == 5
        # a light one ends: the queue's head (the flood's) runs in the normal slot freed,
        # and the waiting light request, under its share again, takes an isolation slot
        await finish(pool, admission, "light")
        assert pool["e"].running == 3 and pool.held == {"flood": 1, "light": 2}
        assert len(admission) == 3 and third.done()
        for task in [*flood, third]:
            task.cancel()

    asyncio.run(scenario())


def test_without_isolation_slots_a_light_tenant_waits_behind_the_running_flood() -> None:
    async def scenario() -> None:
        pool, admission = make(max_running=2, isolation_slots=0)
        for _ in range(2):
            await admission.admit(Request("flood", 100, 0), Holdings())
        flood = asyncio.create_task(admission.admit(Request("flood", 100, 0), Holdings()))
        await asyncio.sleep(0)
        light = asyncio.create_task(admission.admit(Request("light", 100, 0), Holdings()))
        await asyncio.sleep(0)
        assert not light.done() and pool["e"].running == 2
        await finish(pool, admission, "flood")
        await finish(pool, admission, "flood")
        assert flood.done() and light.done()  # served in the queue's order once slots freed

    asyncio.run(scenario())
