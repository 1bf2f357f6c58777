"""Layer-wise streaming of a prefill's KV: how much has landed on the decode node when the
prefill's last layer ends, and how long the rest takes.

A prefill of ``prefill_s`` over ``layers`` equal layers finishes layer ``i`` at
``(i + 1) * prefill_s / layers``; each layer's KV (``kv_bytes / layers``) leaves as soon as it
is computed and the link before it is free (one link, sent in layer order: what kvfabric's
push path does), at ``bytes_per_s``. With ``c`` the compute time of a layer and ``s`` its send
time, layer ``i`` has landed at ``c + s + i * max(c, s)`` when the link keeps up
(``s <= c``: everything but the last layer is there at prefill end) and the link is the
bottleneck otherwise. ``fixed_s`` (a hand-off's fixed cost) delays every layer alike.

Pure arithmetic, exact for this model; the simulator's P/D hand-offs and the planner's
figures use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Overlap:
    landed_fraction: float  # of the KV bytes, on the decode node when prefill ends
    tail_s: float  # after prefill ends, until the last byte has landed


def layerwise(
    prefill_s: float, kv_bytes: float, layers: int, bytes_per_s: float, fixed_s: float = 0.0
) -> Overlap:
    if layers < 1 or not bytes_per_s > 0 or prefill_s < 0 or kv_bytes < 0 or fixed_s < 0:
        raise ValueError("layers >= 1, bytes_per_s > 0, and no negative time or size")
    if kv_bytes == 0:
        return Overlap(1.0, 0.0)
    c = prefill_s / layers
    s = kv_bytes / layers / bytes_per_s
    # landing time of layer i: the first after c + fixed + s, then one per max(c, s)
    first = c + fixed_s + s
    pace = max(c, s)
    last = first + (layers - 1) * pace
    if prefill_s >= last:
        return Overlap(1.0, 0.0)
    # bytes landed by prefill_s: whole layers landed, plus the part of the one in flight
    if prefill_s < first - s:
        landed_layers = 0.0
    else:
        done = int((prefill_s - first) // pace) + 1 if prefill_s >= first else 0
        done = min(done, layers)
        # the layer after them started sending at its compute end (or the link's free time)
        start_next = first - s + done * pace
        partial = min(1.0, max(0.0, prefill_s - start_next) / s) if done < layers else 0.0
        landed_layers = done + partial
    return Overlap(landed_layers / layers, last - prefill_s)
