"""A request's tenant and class: keys when configured (a batch key cannot ask for
interactive), headers otherwise."""

from __future__ import annotations

import pytest

from kvfabric.gateway.config import ApiKeyConfig
from kvfabric.gateway.tenancy import BadHeader, Unauthorized, identify
from kvfabric.sched.model import Priority

KEYS = {
    "sk-a": ApiKeyConfig("alice", "interactive"),
    "sk-b": ApiKeyConfig("bob", "batch"),
}


def test_without_keys_the_tenant_and_class_come_from_headers() -> None:
    assert identify({}, {}).tenant == "default"
    caller = identify({"x-kvfabric-tenant": "t1", "x-kvfabric-priority": "Batch"}, {})
    assert (caller.tenant, caller.priority) == ("t1", Priority.BATCH)


def test_with_keys_a_key_names_the_tenant_and_caps_the_class() -> None:
    alice = identify({"authorization": "Bearer sk-a", "x-kvfabric-tenant": "bob"}, KEYS)
    assert (alice.tenant, alice.priority) == ("alice", Priority.INTERACTIVE)
    lowered = identify({"authorization": "Bearer sk-a", "x-kvfabric-priority": "batch"}, KEYS)
    assert lowered.priority is Priority.BATCH
    raised = identify({"authorization": "bearer sk-b", "x-kvfabric-priority": "interactive"}, KEYS)
    assert (raised.tenant, raised.priority) == ("bob", Priority.BATCH)


@pytest.mark.parametrize("auth", [None, "Bearer nope", "Basic sk-a", "sk-a"])
def test_with_keys_no_key_or_an_unknown_one_is_refused(auth: str | None) -> None:
    with pytest.raises(Unauthorized):
        identify({} if auth is None else {"authorization": auth}, KEYS)


@pytest.mark.parametrize(
    "headers",
    [
        {"x-kvfabric-priority": "urgent"},
        {"x-kvfabric-tenant": "x" * 129},
        {"x-kvfabric-tenant": "a\nb"},
    ],
)
def test_bad_headers_are_refused(headers: dict[str, str]) -> None:
    with pytest.raises(BadHeader):
        identify(headers, {})
