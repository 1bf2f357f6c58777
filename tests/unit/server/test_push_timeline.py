"""A push's timeline, on a fixed clock: how much of the KV had landed when the producer's
last layer was committed, and what the decode still waited for after it."""

from __future__ import annotations

import pytest

from kvfabric.server.push_timeline import LayerBatch, PushTimeline, TimelineRecorder


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def streamed(layers: int, compute_s: float, move_s: float, start: float = 0.0) -> PushTimeline:
    """The pusher's loop on a fake clock: the producer commits layer i at start + (i + 1) *
    compute_s; the pusher waits for the next layer when it is not there yet, moves it with
    every later one committed meanwhile, and each move takes move_s."""
    clock = FakeClock()
    recorder = TimelineRecorder(clock)
    committed = [start + (i + 1) * compute_s for i in range(layers)]
    first = 0
    while first < layers:
        waited = committed[first] > clock.now
        clock.now = max(clock.now, committed[first])
        ready = recorder.seen(waited)
        stop = first + 1
        while stop < layers and committed[stop] <= clock.now:
            stop += 1
        clock.now += move_s
        recorder.landed(first, stop, ready)
        first = stop
    timeline = recorder.timeline()
    assert timeline is not None
    return timeline


def test_a_pusher_that_keeps_up_lands_all_but_the_last_layer_by_prefill_end() -> None:
    timeline = streamed(layers=32, compute_s=0.010, move_s=0.002)
    assert len(timeline.batches) == 32
    assert timeline.source_end == pytest.approx(0.320)
    assert timeline.landed_fraction == 31 / 32  # >= 0.95: the seed's bar
    assert timeline.tail_s == pytest.approx(0.002)  # one layer's move


def test_a_slow_link_batches_layers_and_misses_the_bar() -> None:
    timeline = streamed(layers=32, compute_s=0.010, move_s=0.025)
    assert len(timeline.batches) < 32  # several layers per transfer once behind
    # the last layer was committed at 0.320; not waiting for it, the pusher cannot tell
    # when in the preceding move it came, so it takes the earliest: before that move
    assert timeline.source_end <= 0.320
    assert timeline.landed_fraction < 0.95
    truth = timeline.batches[-1].landed - 0.320
    assert timeline.tail_s >= truth > 0.025  # never shorter than the truth


def test_chunks_complete_before_the_push_are_one_batch_from_the_push_start() -> None:
    timeline = streamed(layers=32, compute_s=0.001, move_s=0.080, start=-1.0)
    assert len(timeline.batches) == 1
    assert (timeline.source_end, timeline.landed_fraction) == (0.0, 0.0)
    assert timeline.tail_s == pytest.approx(0.080)  # all of it after the push began


def test_chunks_complete_before_the_push_move_in_one_batch_the_baseline() -> None:
    timeline = PushTimeline((LayerBatch(0, 32, ready=5.0, landed=5.08),))
    assert timeline.landed_fraction == 0.0
    assert timeline.tail_s == pytest.approx(0.08)  # the whole "send after prefill"
    assert timeline.summary() == {
        "landed_fraction": 0.0,
        "tail_ms": 80.0,
        "layers_moved": 32,
        "batches": 1,
    }


def test_a_batch_landing_exactly_at_prefill_end_counts_as_landed() -> None:
    timeline = PushTimeline(
        (LayerBatch(0, 3, ready=1.0, landed=2.0), LayerBatch(3, 4, ready=2.0, landed=2.5))
    )
    assert timeline.landed_fraction == 0.75


@pytest.mark.parametrize(
    "batches",
    [
        (),
        (LayerBatch(0, 2, 1.0, 1.1), LayerBatch(3, 4, 1.2, 1.3)),  # a layer skipped
        (LayerBatch(0, 2, 1.0, 1.1), LayerBatch(2, 4, 0.9, 1.3)),  # ready going back
        (LayerBatch(0, 2, 1.0, 0.9),),  # landed before it was ready
        (LayerBatch(2, 2, 1.0, 1.1),),  # no layer
    ],
)
def test_impossible_timelines_are_refused(batches: tuple[LayerBatch, ...]) -> None:
    with pytest.raises(ValueError):
        PushTimeline(batches)
