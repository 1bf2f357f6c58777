"""Engines' measured throughput, refining what their hardware class's profile says.

A gateway reports each finished phase: an engine prefilled ``tokens`` in ``seconds``, or
decoded them. :class:`Throughput` keeps an exponentially weighted average per engine and
phase (``alpha`` the weight of a new sample) and, until an engine has been measured, answers
with its class's configured prior; so a fresh engine is planned by its class, a measured one
by what it did. Samples of no tokens or no time are ignored (they carry no rate).

The fixed cost of a prefill -> decode hand-off is measured the same way, for the cluster as a
whole: what a decode engine's first token took past the KV transfer the plan modelled (the
decode request's scheduling, its load of the KV, its first step). A configured prior of a few
ms makes the planner split requests whose hand-off costs tens of ms on small engines; once
measured, a split must save more than it really costs.

Pure and not thread-safe, like the rest of :mod:`kvfabric.sched`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class ClassPrior:
    """A hardware class's configured rates (tokens/s): one request's prefill, one stream's
    decode."""

    prefill_tps: float
    decode_tps: float

    def rate(self, phase: str) -> float:
        return self.prefill_tps if phase == PREFILL else self.decode_tps


class Throughput:
    """Per engine and phase: the measured rate, or the class prior (module docstring)."""

    def __init__(self, priors: Mapping[str, ClassPrior], alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self._priors = dict(priors)
        self._alpha = alpha
        self._rates: dict[tuple[str, str], float] = {}
        self._handoff_s: float | None = None

    def observe(self, engine_id: str, phase: str, tokens: int, seconds: float) -> None:
        if phase not in (PREFILL, DECODE):
            raise ValueError(f"phase must be {PREFILL!r} or {DECODE!r}, got {phase!r}")
        if tokens <= 0 or seconds <= 0:
            return
        sample = tokens / seconds
        key = (engine_id, phase)
        old = self._rates.get(key)
        self._rates[key] = sample if old is None else old + self._alpha * (sample - old)

    def rate(self, engine_id: str, hardware_class: str, phase: str) -> float:
        """The engine's measured rate; its class prior before any sample (KeyError for a
        class with neither: the configuration must name every class it runs)."""
        measured = self._rates.get((engine_id, phase))
        if measured is not None:
            return measured
        return self._priors[hardware_class].rate(phase)

    def observe_handoff(self, seconds: float) -> None:
        """A hand-off's fixed cost as measured (see the module docstring); negatives are 0."""
        sample = max(0.0, seconds)
        old = self._handoff_s
        self._handoff_s = sample if old is None else old + self._alpha * (sample - old)

    def handoff_s(self, prior: float) -> float:
        """The measured fixed cost of a hand-off, or ``prior`` before any sample."""
        return prior if self._handoff_s is None else self._handoff_s
