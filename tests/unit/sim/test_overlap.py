"""Layer-wise streaming: what has landed when prefill ends, against a hand-run timeline."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.sim.overlap import layerwise


def timeline(prefill_s: float, kv_bytes: float, layers: int, bw: float, fixed: float):
    """Layer by layer, the way a sender with one link does it."""
    c, s = prefill_s / layers, kv_bytes / layers / bw
    free, landed = 0.0, []
    for i in range(layers):
        start = max((i + 1) * c + fixed, free)
        free = start + s
        landed.append((start, free))
    return landed


def landed_at(t: float, landed: list[tuple[float, float]]) -> float:
    return sum(min(1.0, max(0.0, (t - a) / (b - a))) for a, b in landed) / len(landed)


def test_a_link_faster_than_compute_leaves_only_the_last_layer_in_flight() -> None:
    # 4 layers of 1 s each, 100 bytes per layer at 200 B/s: 0.5 s to send one
    got = layerwise(prefill_s=4.0, kv_bytes=400, layers=4, bytes_per_s=200)
    assert got.landed_fraction == pytest.approx(3 / 4)
    assert got.tail_s == pytest.approx(0.5)


def test_a_slow_link_is_the_bottleneck() -> None:
    # 4 layers of 1 s, 2 s to send each: layer i lands at 1 + 2(i+1)
    got = layerwise(prefill_s=4.0, kv_bytes=400, layers=4, bytes_per_s=50)
    assert got.landed_fraction == pytest.approx(1.5 / 4)  # one landed at 3, half of the next
    assert got.tail_s == pytest.approx(9.0 - 4.0)


def test_no_bytes_have_nothing_to_wait_for() -> None:
    assert layerwise(1.0, 0, 32, 1e9).landed_fraction == 1.0


@given(
    prefill=st.floats(0.01, 10),
    kv=st.floats(1, 1e6),
    layers=st.integers(1, 96),
    bw=st.floats(1, 1e6),
    fixed=st.floats(0, 0.5),
)
def test_the_closed_form_matches_the_layer_by_layer_timeline(
    prefill: float, kv: float, layers: int, bw: float, fixed: float
) -> None:
    got = layerwise(prefill, kv, layers, bw, fixed)
    line = timeline(prefill, kv, layers, bw, fixed)
    assert got.landed_fraction == pytest.approx(landed_at(prefill, line), abs=1e-9)
    assert got.tail_s == pytest.approx(max(0.0, line[-1][1] - prefill), rel=1e-9, abs=1e-9)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        layerwise(1.0, 10, 0, 1e9)
