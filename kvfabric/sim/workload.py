"""What arrives at a simulated cluster: request arrival times, prompt and output lengths,
tenants, shared prefixes.

A :class:`Workload` is a sequence of :class:`Phase` values, each with its own arrival
process (Poisson, or bursty: an on/off modulated Poisson process whose long-run rate is the
phase's rate), length distributions and duration, so a mix that shifts halfway is two
phases. :func:`generate` draws every request up front from one seed (numpy's PCG64): the
same workload and seed give the same requests on any machine.

Length distributions (:class:`Lengths`): ``fixed``, ``uniform`` (low..high inclusive),
``lognormal`` (the mean and the sigma of the log), ``exponential`` (the mean; at least 1) or
``empirical`` (values drawn with replacement, e.g. an ingress log's lengths read by
:func:`lengths_from_file`).

Prefix sharing: a request belongs to one of ``prefix_groups`` groups (0: none) and its first
``shared_prefix_tokens`` tokens are its group's, so the fabric can hold them for the next one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvfabric.sched.model import Priority

LENGTH_KINDS = ("fixed", "uniform", "lognormal", "exponential", "empirical")


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution (see the module docstring)."""

    kind: str = "fixed"
    mean: float = 0.0
    sigma: float = 0.0
    low: int = 0
    high: int = 0
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.kind == "empirical" and not self.values:
            raise ValueError("an empirical length distribution needs values")
        if self.kind == "uniform" and not 0 <= self.low <= self.high:
            raise ValueError("uniform lengths need 0 <= low <= high")
        if self.kind in ("fixed", "lognormal", "exponential") and self.mean < 0:
            raise ValueError("mean must be >= 0")

    @classmethod
    def fixed(cls, tokens: int) -> Lengths:
        return cls("fixed", mean=float(tokens))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths (int64, each >= 0; >= 1 for the exponential)."""
        if self.kind == "fixed":
            return np.full(n, round(self.mean), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)
        if self.kind == "lognormal":
            # mu such that the distribution's mean is self.mean
            mu = np.log(max(self.mean, 1e-9)) - self.sigma**2 / 2
            return np.rint(rng.lognormal(mu, self.sigma, size=n)).astype(np.int64)
        drawn: np.ndarray
        if self.kind == "exponential":
            drawn = np.maximum(1, np.rint(rng.exponential(self.mean, size=n))).astype(np.int64)
        else:
            drawn = rng.choice(np.asarray(self.values, dtype=np.int64), size=n)
        return drawn

    def expected(self) -> float:
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "empirical":
            return float(np.mean(self.values))
        return self.mean


def lengths_from_file(path: str | Path, key: str) -> Lengths:
    """An empirical distribution from a JSON-lines file of objects with ``key`` (e.g.
    ``prompt_tokens`` / ``output_tokens``); ValueError naming the line that lacks it."""
    values = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get(key), int) or row[key] < 0:
            raise ValueError(f"{path}:{number}: {key!r} must be an int >= 0")
        values.append(row[key])
    return Lengths("empirical", values=tuple(values))


@dataclass(frozen=True)
class Tenant:
    name: str
    share: float = 1.0  # of the phase's arrivals
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True)
class Phase:
    """``duration_s`` of arrivals at ``rate_rps`` (long-run mean). ``bursty``: on/off periods
    (exponential, ``burst_on_s`` / ``burst_off_s`` long on average) with arrivals only while
    on, at the rate that keeps the mean."""

    rate_rps: float
    duration_s: float
    prompt: Lengths
    output: Lengths
    tenants: tuple[Tenant, ...] = (Tenant("default"),)
    bursty: bool = False
    burst_on_s: float = 1.0
    burst_off_s: float = 3.0
    prefix_groups: int = 0
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.rate_rps > 0 or not self.duration_s > 0:
            raise ValueError("rate_rps and duration_s must be > 0")
        if not self.tenants or any(t.share <= 0 for t in self.tenants):
            raise ValueError("a phase needs tenants with positive shares")


@dataclass(frozen=True)
class Workload:
    phases: tuple[Phase, ...]

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)


@dataclass(frozen=True)
class SimRequest:
    """One request as drawn: ``shared_tokens`` of its prompt are its prefix group's."""

    rid: int
    arrival_s: float
    tenant: str
    priority: Priority
    prompt_tokens: int
    output_tokens: int
    group: int = -1
    shared_tokens: int = 0
    phase: int = 0


def generate(workload: Workload, seed: int) -> list[SimRequest]:
    """Every request of ``workload`` in arrival order, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    out: list[SimRequest] = []
    origin = 0.0
    for index, phase in enumerate(workload.phases):
        times = _arrival_times(rng, phase) + origin
        n = len(times)
        prompts = phase.prompt.sample(rng, n)
        outputs = np.maximum(1, phase.output.sample(rng, n))
        shares = np.array([t.share for t in phase.tenants], dtype=float)
        who = rng.choice(len(phase.tenants), size=n, p=shares / shares.sum())
        groups = (
            rng.integers(0, phase.prefix_groups, size=n)
            if phase.prefix_groups
            else np.full(n, -1, dtype=np.int64)
        )
        for i in range(n):
            tenant = phase.tenants[int(who[i])]
            prompt = int(prompts[i])
            shared = min(prompt, phase.shared_prefix_tokens) if groups[i] >= 0 else 0
            out.append(
                SimRequest(
                    rid=len(out),
                    arrival_s=float(times[i]),
                    tenant=tenant.name,
                    priority=tenant.priority,
                    prompt_tokens=max(1, prompt),
                    output_tokens=int(outputs[i]),
                    group=int(groups[i]) + index * 1_000_000 if groups[i] >= 0 else -1,
                    shared_tokens=shared,
                    phase=index,
                )
            )
        origin += phase.duration_s
    return out


def _arrival_times(rng: np.random.Generator, phase: Phase) -> np.ndarray:
    if not phase.bursty:
        return _poisson(rng, phase.rate_rps, 0.0, phase.duration_s)
    on_rate = phase.rate_rps * (phase.burst_on_s + phase.burst_off_s) / phase.burst_on_s
    chunks: list[np.ndarray] = []
    t = 0.0
    while t < phase.duration_s:
        on = rng.exponential(phase.burst_on_s)
        end = min(t + on, phase.duration_s)
        chunks.append(_poisson(rng, on_rate, t, end))
        t = end + rng.exponential(phase.burst_off_s)
    return np.concatenate(chunks) if chunks else np.empty(0)


def _poisson(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    # enough exponential gaps to pass `end` with overwhelming probability, then cut
    expected = rate * (end - start)
    n = int(expected + 10 * np.sqrt(expected + 1) + 10)
    times = start + np.cumsum(rng.exponential(1.0 / rate, size=n))
    while times[-1] < end:  # the rare draw that fell short
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=n))
        times = np.concatenate([times, more])
    return times[times < end]


def mean_lengths(requests: Sequence[SimRequest]) -> tuple[float, float]:
    """Mean prompt and output tokens of ``requests`` ((0, 0) for none)."""
    if not requests:
        return 0.0, 0.0
    return (
        float(np.mean([r.prompt_tokens for r in requests])),
        float(np.mean([r.output_tokens for r in requests])),
    )
