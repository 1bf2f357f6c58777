"""The Store protocol: TieredStore and InstrumentedStore both implement it, member by member.

Statically, the two functions below are what mypy checks (an assignment to ``Store`` of each
class); at run time every member of the protocol must exist on both classes with the same
kind (method or property) and the same parameters: names, kinds, defaults and annotations.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import pytest

from kvfabric.server.instrumented import InstrumentedStore
from kvfabric.store import TieredStore
from kvfabric.store.protocol import Store

if TYPE_CHECKING:
    from kvfabric.lookup import LookupResult
    from kvfabric.spec import Namespace
    from kvfabric.store.protocol import TokenIds

MEMBERS = sorted(name for name in vars(Store) if not name.startswith("_"))


def _tiered_store_is_a_store(store: TieredStore) -> Store:
    return store  # mypy: TieredStore implements Store


def _instrumented_store_is_a_store(store: InstrumentedStore) -> Store:
    return store  # mypy: InstrumentedStore implements Store


def parameters(fn: object) -> list[tuple[str, object, object, object]]:
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    ]


def test_the_members_are_found() -> None:  # the parametrized test below is not vacuous
    assert {"reserve", "get", "lookup", "stats", "tier_names", "nonblocking"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", [TieredStore, InstrumentedStore])
@pytest.mark.parametrize("name", MEMBERS)
def test_both_stores_implement_every_member_alike(cls: type, name: str) -> None:
    wanted = vars(Store)[name]
    actual = inspect.getattr_static(cls, name)
    if isinstance(wanted, property):
        assert isinstance(actual, property), f"{cls.__name__}.{name} must be a property"
        return
    assert callable(actual), f"{cls.__name__}.{name} must be a method"
    assert parameters(actual) == parameters(wanted), f"{cls.__name__}.{name}"


def test_the_comparison_catches_a_different_signature() -> None:
    # negative control: the same parameters but one default is a mismatch
    def lookup_tokens(  # type: ignore[no-untyped-def]
        self, ns: Namespace, tokens: TokenIds, *, peer_chunks: int = 1
    ) -> LookupResult:
        raise NotImplementedError

    def same(  # type: ignore[no-untyped-def]
        self, ns: Namespace, tokens: TokenIds, *, peer_chunks: int = 0
    ) -> LookupResult:
        raise NotImplementedError

    assert parameters(same) == parameters(vars(Store)["lookup_tokens"])
    assert parameters(lookup_tokens) != parameters(vars(Store)["lookup_tokens"])
