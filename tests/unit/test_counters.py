"""The counter helper every engine plugin counts with: fixed names, adds from any thread,
copies for readers."""

from __future__ import annotations

import threading

import pytest

from kvfabric.counters import Counters


def test_counters_start_at_zero_and_add_up() -> None:
    counters = Counters[int](("hits", "misses"))
    assert counters.snapshot() == {"hits": 0, "misses": 0}
    counters.add(hits=2)
    counters.add(hits=1, misses=4)
    assert counters.snapshot() == {"hits": 3, "misses": 4}


def test_an_unknown_name_raises_and_changes_nothing() -> None:
    counters = Counters[int](("hits",))
    with pytest.raises(KeyError, match="hitz"):
        counters.add(hits=1, hitz=1)
    assert counters.snapshot() == {"hits": 0}


def test_take_returns_the_interval_and_starts_a_new_one() -> None:
    counters = Counters[float](("seconds",))
    counters.add(seconds=0.25)
    assert counters.take() == {"seconds": 0.25}
    assert counters.take() == {"seconds": 0}


def test_readers_get_copies() -> None:
    counters = Counters[int](("hits",))
    seen = counters.snapshot()
    seen["hits"] = 99
    assert counters.snapshot() == {"hits": 0}


def test_adds_from_many_threads_are_not_lost() -> None:
    counters = Counters[int](("a", "b"))

    def count() -> None:
        for _ in range(10_000):
            counters.add(a=1, b=2)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters.snapshot() == {"a": 80_000, "b": 160_000}
