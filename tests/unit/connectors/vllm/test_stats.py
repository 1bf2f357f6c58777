"""Connector counters as vLLM aggregates and logs them."""

from __future__ import annotations

from kvfabric_connectors.vllm.stats import KVFabricConnectorStats, TransferCounters


def test_counters_are_taken_per_interval_and_kept_in_totals() -> None:
    counters = TransferCounters()
    assert counters.take() is None  # nothing happened: nothing to report
    counters.add(loaded_chunks=2, loaded_tokens=512)
    counters.add(loaded_chunks=1, load_errors=1)
    first = counters.take()
    assert first is not None and first.data == {
        "loaded_chunks": 3,
        "loaded_tokens": 512,
        "load_errors": 1,
    }
    assert counters.take() is None
    assert counters.totals()["loaded_chunks"] == 3


def test_worker_snapshots_aggregate_and_reduce_to_every_counter() -> None:
    a = KVFabricConnectorStats(data={"saved_chunks": 2})
    b = KVFabricConnectorStats(data={"saved_chunks": 3, "save_errors": 1})
    total = a.aggregate(b)
    reduced = total.reduce()
    assert reduced["saved_chunks"] == 5 and reduced["save_errors"] == 1
    assert reduced["loaded_tokens"] == 0  # every counter is always present
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()
