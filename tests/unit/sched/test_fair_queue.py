"""Tenants share the engines by weight, in tokens; interactive goes first; a full queue
refuses with a retry-after."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.sched.fair_queue import FairQueue, QueueFull
from kvfabric.sched.model import Priority, Request


def served_shares(queue: FairQueue[int], count: int) -> dict[str, int]:
    served: dict[str, int] = {}
    for _ in range(count):
        popped = queue.pop()
        assert popped is not None
        request, _ = popped
        served[request.tenant] = served.get(request.tenant, 0) + request.budget_tokens
    return served


def test_backlogged_tenants_are_served_tokens_in_the_ratio_of_their_weights() -> None:
    queue: FairQueue[int] = FairQueue({"heavy": 3.0, "light": 1.0}, max_queued_tokens=10**9)
    for i in range(400):  # heavy sends short requests, light long ones: tokens count
        queue.push(Request("heavy", 90, 10), i, 1.0)
        queue.push(Request("light", 900, 100), i, 1.0)
    served = served_shares(queue, 300)
    share = served["heavy"] / (served["heavy"] + served["light"])
    assert share == pytest.approx(0.75, abs=0.02)


def test_a_tenant_that_was_idle_gets_no_credit_for_it() -> None:
    queue: FairQueue[int] = FairQueue({}, max_queued_tokens=10**9)
    for i in range(100):
        queue.push(Request("early", 100, 0), i, 1.0)
    served_shares(queue, 90)
    for i in range(20):
        queue.push(Request("late", 100, 0), i, 1.0)
    # from now on they alternate: the late one does not catch up on 90 missed turns
    order = [queue.pop()[0].tenant for _ in range(10)]  # type: ignore[index]
    assert order.count("late") == 5


def test_interactive_requests_overtake_queued_batch_ones() -> None:
    queue: FairQueue[str] = FairQueue({}, max_queued_tokens=10**9)
    queue.push(Request("a", 10, 10, Priority.BATCH), "batch-1", 1.0)
    queue.push(Request("a", 10, 10, Priority.BATCH), "batch-2", 1.0)
    queue.push(Request("b", 10, 10, Priority.INTERACTIVE), "interactive", 1.0)
    assert [queue.pop()[1] for _ in range(3)] == ["interactive", "batch-1", "batch-2"]  # type: ignore[index]
    assert queue.pop() is None


def test_a_full_queue_refuses_with_the_time_the_queue_ahead_needs() -> None:
    queue: FairQueue[int] = FairQueue({}, max_queued_tokens=1_000)
    queue.push(Request("a", 500, 300), 1, 100.0)
    queue.push(Request("b", 1_000, 0), 2, 100.0)
    with pytest.raises(QueueFull) as refused:
        queue.push(Request("a", 150, 100), 3, 100.0)  # 800 + 250 > 1,000
    assert refused.value.tenant == "a"
    assert refused.value.retry_after_s == pytest.approx((800 + 1_000) / 100.0)
    queue.push(Request("a", 100, 100), 3, 100.0)  # 1,000: fits exactly
    while queue.pop() is not None:
        pass
    assert queue.queued_tokens("a") == queue.queued_tokens("b") == 0 and len(queue) == 0


def test_a_request_served_out_of_order_leaves_the_rest_in_order_and_is_charged() -> None:
    queue: FairQueue[str] = FairQueue({}, max_queued_tokens=10**6)
    for i in range(3):
        queue.push(Request("flood", 100, 0), f"flood{i}", 1.0)
    queue.push(Request("light", 100, 0), "light0", 1.0)
    queue.push(Request("light", 100, 0), "light1", 1.0)
    assert [item for _, item in queue.ordered()] == [
        "flood0",
        "light0",
        "flood1",
        "light1",
        "flood2",
    ]
    assert queue.remove("light0").tenant == "light"
    assert queue.queued_requests("light") == 1 and queue.queued_tokens("light") == 100
    with pytest.raises(KeyError):
        queue.remove("light0")
    # the removed request's finish tag stays light's: light1 keeps its place behind flood1
    assert [queue.pop()[1] for _ in range(4)] == ["flood0", "flood1", "light1", "flood2"]  # type: ignore[index]


def test_a_tenant_is_under_its_share_while_it_holds_fewer_slots_than_its_weight_gives() -> None:
    queue: FairQueue[int] = FairQueue({"flood": 1.0, "big": 3.0}, max_queued_tokens=10**6)
    queue.push(Request("flood", 100, 0), 0, 1.0)  # flood is active: it has one queued
    held = {"flood": 4, "light": 1}
    # capacity 8 between flood and light (weights 1 and 1): 4 slots each
    assert queue.under_share("light", held, capacity=8)
    assert not queue.under_share("flood", held, capacity=8)
    assert not queue.under_share("light", {"flood": 4, "light": 4}, capacity=8)
    # a tenant neither holding nor queueing does not dilute the others' shares
    assert queue.under_share("flood", {"flood": 4}, capacity=8)  # all 8 are its share
    assert queue.under_share("big", {"flood": 4, "big": 5}, capacity=8)  # 3/4 of 8 = 6


def test_a_tenant_is_backlogged_with_more_requests_waiting_than_the_limit() -> None:
    queue: FairQueue[int] = FairQueue({}, max_queued_tokens=10**6)
    for i in range(3):
        queue.push(Request("flood", 10, 0), i, 1.0)
    queue.push(Request("light", 10, 0), 9, 1.0)
    assert queue.backlogged(2) == {"flood"} and queue.backlogged(3) == set()
    queue.pop()
    assert queue.backlogged(2) == set()


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FairQueue({"a": 0.0}, max_queued_tokens=10)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcd"), st.floats(0.25, 8.0), min_size=2, max_size=4),
    st.lists(st.integers(1, 400), min_size=1, max_size=8),
)
def test_fair_shares_converge_to_the_weights(weights: dict[str, float], sizes: list[int]) -> None:
    """Every tenant backlogged with requests of mixed sizes: after many are served, each
    tenant's share of the served tokens is within 0.1 of its weight's share."""
    queue: FairQueue[int] = FairQueue(weights, max_queued_tokens=10**12)
    for i in range(600):
        for tenant in weights:
            queue.push(Request(tenant, sizes[i % len(sizes)], 0), i, 1.0)
    served = served_shares(queue, 500)  # fewer than any tenant queued: all stay backlogged
    total_served = sum(served.values())
    total_weight = sum(weights.values())
    for tenant, weight in weights.items():
        assert served.get(tenant, 0) / total_served == pytest.approx(weight / total_weight, abs=0.1)
