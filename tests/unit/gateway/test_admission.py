"""Admission in front of the engines' slots: a request runs at once while engines have room,
waits in the tenants' fair queue when they do not, and is handed its plan (its engines'
slots taken) in the queue's order as slots free."""

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


def make(max_running: int = 1, max_queued: int = 10_000) -> tuple[EnginePool, Admission]:
    metrics = GatewayMetrics()
    engine = EngineConfig("e", "http://127.0.0.1:9", "gpu", max_running=max_running)
    pool = EnginePool([engine], CLASSES, metrics)
    pool.mark("e", True)
    return pool, Admission(pool, POLICY, {"heavy": 3.0}, max_queued, metrics)


async def finish(pool: EnginePool, admission: Admission) -> None:
    """An engine's request ended: its slot back, the queue's head served."""
    pool.give_back("e")
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
