"""How far a push kept up with the prefill that produced its chunks.

The pusher (:mod:`kvfabric.server.pusher`) moves a chunk's layers as they are committed
here, several layers in one transfer when it fell behind. For every batch it notes two
instants on one monotonic clock: ``ready``, when every chunk of the push had committed the
batch's last layer here (for chunks being computed: when the producer's forward pass
finished that layer), and ``landed``, when the target acknowledged the batch's commit (its
readers can use those layers from then on).

The pusher sees a commit when it looks, so :class:`TimelineRecorder` takes for ``ready``:
the moment its wait for the batch's first layer ended, when it had to wait (the commit just
happened); otherwise the moment it last looked before, when those layers were not all
committed yet (the earliest the commit can have been). Behind its producer the pusher thus
errs on the early side, which lowers the landed fraction and lengthens the tail: the
figures can only look worse than they were. From these:

- ``source_end``: the last layer's ``ready``: for a push that follows a prefill, the end of
  that prefill (what the decode side would otherwise start waiting from);
- ``landed_fraction``: the share of the push's layers landed on the target by
  ``source_end``, the streaming bar (the last layer lands after it, so at most
  ``(layers - 1) / layers``);
- ``tail_s``: from ``source_end`` to the last layer landing: what the prefill-to-decode
  hand-off still costs once prefill ended.

A push of chunks complete before it began moves every layer in one batch: landed fraction
0, and its tail is the whole transfer, the "send after prefill" baseline the streaming is
measured against (``benchmarks/pd_stream_bench.py``).

Values only; the pusher owns the clock (injectable, so tests drive it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerBatch:
    """Layers ``[first, stop)`` moved in one transfer and one commit."""

    first: int
    stop: int
    ready: float
    landed: float


@dataclass(frozen=True)
class PushTimeline:
    """The batches of one push, in order (see the module docstring)."""

    batches: tuple[LayerBatch, ...]

    def __post_init__(self) -> None:
        if not self.batches:
            raise ValueError("a push timeline needs at least one batch")
        for before, after in zip(self.batches, self.batches[1:]):
            if after.first != before.stop or after.ready < before.ready:
                raise ValueError(f"batches out of order: {before} then {after}")
        for batch in self.batches:
            if batch.stop <= batch.first or batch.landed < batch.ready:
                raise ValueError(f"not a batch: {batch}")

    @property
    def layers(self) -> int:
        return self.batches[-1].stop - self.batches[0].first

    @property
    def source_end(self) -> float:
        return self.batches[-1].ready

    @property
    def landed_fraction(self) -> float:
        end = self.source_end
        landed = sum(b.stop - b.first for b in self.batches if b.landed <= end)
        return landed / self.layers

    @property
    def tail_s(self) -> float:
        return self.batches[-1].landed - self.source_end

    def summary(self) -> dict[str, float]:
        """The push reply's fields (milliseconds for people reading a JSON reply)."""
        return {
            "landed_fraction": round(self.landed_fraction, 4),
            "tail_ms": round(self.tail_s * 1000, 3),
            "layers_moved": self.layers,
            "batches": len(self.batches),
        }


class TimelineRecorder:
    """Notes a push's batches as the pusher moves them (one per push, its thread only).

    Per batch: :meth:`seen` once the pusher knows which layers it moves (``waited``: it had
    to wait for the first of them), then :meth:`landed` once the target committed them.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._looked = clock()  # nothing was known to be committed before the push began
        self._batches: list[LayerBatch] = []

    def seen(self, waited: bool) -> float:
        """The batch's ``ready``: now if the pusher waited, else when it last looked."""
        now = self._clock()
        ready = now if waited else self._looked
        self._looked = now
        return ready

    def landed(self, first: int, stop: int, ready: float) -> None:
        self._batches.append(LayerBatch(first, stop, ready, self._clock()))

    def timeline(self) -> PushTimeline | None:
        return PushTimeline(tuple(self._batches)) if self._batches else None
