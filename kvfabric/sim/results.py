"""What a simulation returns: every request's times, and the figures a plan reads.

TTFT is from arrival to the client's first token (queue, fetches, prefill, hand-off and the
decode engine's first step included); TPOT is the mean time between the following tokens
(``(done - first) / (output - 1)``; undefined for a one-token output). Percentiles
interpolate as numpy's ``percentile`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestResult:
    rid: int
    tenant: str
    priority: str
    phase: int
    arrival_s: float
    dispatched_s: float
    first_s: float
    done_s: float
    prompt_tokens: int
    output_tokens: int
    prefill_engine: str
    decode_engine: str
    mode: str
    reused_tokens: int
    landed_fraction: float = math.nan  # a P/D hand-off: of the KV, there when prefill ended
    prefilled_s: float = math.nan  # when the prefill engine finished its part (single: first_s)

    @property
    def prefill_side_s(self) -> float:
        """Of the TTFT: waiting for and running the prefill (queue, fetches included)."""
        return self.prefilled_s - self.arrival_s

    @property
    def decode_side_s(self) -> float:
        """Of the TTFT: the hand-off and the decode engine's wait and first step."""
        return self.first_s - self.prefilled_s

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.done_s - self.first_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Summary:
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    tokens_per_s: float  # prompt + output tokens served per second of the horizon
    utilisation: Mapping[str, float]  # per engine: busy seconds over the horizon
    cost_per_hour: float
    cost_per_million_tokens: float


@dataclass(frozen=True)
class SimResult:
    requests: tuple[RequestResult, ...]
    horizon_s: float
    busy_s: Mapping[str, float]
    events: int  # simpy events scheduled
    wall_s: float
    cost_per_hour: float
    fabric_hits: Mapping[str, int]  # reused tokens by tier: dram, ssd, remote

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else math.inf

    def ttft_blame(self, bound_s: float, pool_of: Callable[[str], str]) -> dict[str, float]:
        """Over the requests whose TTFT passed ``bound_s``: the seconds each pool of engines
        (``pool_of(engine_id)``) added to them, prefill side to the prefill engine's pool,
        hand-off and first decode step to the decode engine's: where to add an engine."""
        blame: dict[str, float] = {}
        for r in self.requests:
            if r.ttft_s > bound_s:
                for engine, seconds in (
                    (r.prefill_engine, r.prefill_side_s),
                    (r.decode_engine, r.decode_side_s),
                ):
                    pool = pool_of(engine)
                    blame[pool] = blame.get(pool, 0.0) + seconds
        return blame

    def summary(self, keep: Callable[[RequestResult], bool] | None = None) -> Summary:
        """The figures over the requests ``keep`` selects (all by default)."""
        chosen = [r for r in self.requests if keep is None or keep(r)]
        return summarise(chosen, self.horizon_s, self.busy_s, self.cost_per_hour)


def summarise(
    requests: Sequence[RequestResult],
    horizon_s: float,
    busy_s: Mapping[str, float],
    cost_per_hour: float,
) -> Summary:
    ttft = [r.ttft_s for r in requests]
    tpot = [r.tpot_s for r in requests if r.output_tokens > 1]
    tokens = sum(r.prompt_tokens + r.output_tokens for r in requests)
    hours = horizon_s / 3600.0
    return Summary(
        requests=len(requests),
        ttft_p50_s=_pct(ttft, 50),
        ttft_p99_s=_pct(ttft, 99),
        tpot_p50_s=_pct(tpot, 50),
        tpot_p99_s=_pct(tpot, 99),
        tokens_per_s=tokens / horizon_s if horizon_s > 0 else 0.0,
        utilisation={e: b / horizon_s if horizon_s > 0 else 0.0 for e, b in busy_s.items()},
        cost_per_hour=cost_per_hour,
        cost_per_million_tokens=cost_per_hour * hours / tokens * 1e6 if tokens else math.nan,
    )


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan
