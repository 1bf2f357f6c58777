"""One simulated engine: continuous batching with a step-time model per hardware class.

An engine runs steps back to back while it has work, like vLLM's scheduler: each step takes
the waiting sequences it has room for (``max_seqs``), gives every decoding sequence one token,
and fills the rest of the step's token budget (``max_batch_tokens``) with prefill chunks in
arrival order. A sequence whose prefill completes in a step emits its first token at the end
of that step (vLLM samples it there); one with no output left then leaves.

Step time (:meth:`EngineProfile.step_s`): a fixed cost for a step that prefills and one for a
step that decodes (each pass reads the weights: the larger applies to a mixed step), plus a
cost per prefill token (compute-bound) and per decoding sequence (the KV each one reads:
memory-bound decode grows with the batch). On a shared host (:class:`Host`), engines whose
threads together pass its cores slow down in proportion while they step together.

Runs inside a :class:`simpy.Environment`; not thread-safe (nothing in a simulation is).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

import simpy

# the prompt length at which a profile's prefill rate is quoted to the planner
REFERENCE_PREFILL_TOKENS = 512


@dataclass(frozen=True)
class EngineProfile:
    """A hardware class's step-time model (seconds) and price (currency units per hour)."""

    name: str
    prefill_base_s: float
    prefill_s_per_token: float
    decode_base_s: float
    decode_s_per_seq: float
    cost_per_hour: float = 0.0
    max_batch_tokens: int = 8192
    max_seqs: int = 256
    threads: float = 1.0  # cores one engine keeps busy while it steps (a shared Host counts)

    def __post_init__(self) -> None:
        for name in ("prefill_base_s", "prefill_s_per_token", "decode_base_s", "decode_s_per_seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.name}: {name} must be >= 0")
        if self.max_batch_tokens < 1 or self.max_seqs < 1 or not self.threads > 0:
            raise ValueError(f"{self.name}: max_batch_tokens and max_seqs >= 1, threads > 0")

    def scaled(self, factor: float) -> EngineProfile:
        """The same engine ``factor`` times slower (or faster) at every step."""
        return dataclasses.replace(
            self,
            prefill_base_s=self.prefill_base_s * factor,
            prefill_s_per_token=self.prefill_s_per_token * factor,
            decode_base_s=self.decode_base_s * factor,
            decode_s_per_seq=self.decode_s_per_seq * factor,
        )

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        if not prefill_tokens and not decode_seqs:
            return 0.0
        base = max(
            self.prefill_base_s if prefill_tokens else 0.0,
            self.decode_base_s if decode_seqs else 0.0,
        )
        return (
            base + prefill_tokens * self.prefill_s_per_token + decode_seqs * self.decode_s_per_seq
        )

    @property
    def prefill_tps(self) -> float:
        """Prefill tokens per second of one ``REFERENCE_PREFILL_TOKENS`` prompt alone."""
        step = self.step_s(REFERENCE_PREFILL_TOKENS, 0)
        return REFERENCE_PREFILL_TOKENS / step if step else math.inf

    @property
    def decode_tps(self) -> float:
        """Tokens per second of one stream decoding alone."""
        step = self.step_s(0, 1)
        return 1.0 / step if step else math.inf


class Host:
    """Cores that engines placed together share (a CPU node running several engines)."""

    def __init__(self, cores: float) -> None:
        if not cores > 0:
            raise ValueError("cores must be > 0")
        self.cores = cores
        self.busy_threads = 0.0

    def slowdown(self, threads: float) -> float:
        """How much slower a step of an engine of ``threads`` runs with what steps now."""
        return max(1.0, (self.busy_threads + threads) / self.cores)


class Seq:
    """A request's work on one engine: prompt tokens left to compute, tokens left to emit."""

    __slots__ = ("arrived_s", "first_s", "on_done", "on_first", "output_left", "prefill_left")

    def __init__(
        self,
        prefill_tokens: int,
        output_tokens: int,
        on_first: Callable[[float], None] | None = None,
        on_done: Callable[[float], None] | None = None,
    ) -> None:
        if prefill_tokens < 1 or output_tokens < 1:
            raise ValueError("a sequence computes at least one token and emits at least one")
        self.prefill_left = prefill_tokens
        self.output_left = output_tokens
        self.first_s = -1.0
        self.arrived_s = -1.0
        self.on_first = on_first
        self.on_done = on_done

    def emit(self, now: float) -> None:
        self.output_left -= 1
        if self.first_s < 0:
            self.first_s = now
            if self.on_first is not None:
                self.on_first(now)
        if not self.output_left and self.on_done is not None:
            self.on_done(now)


class SimEngine:
    def __init__(
        self, env: simpy.Environment, engine_id: str, profile: EngineProfile, host: Host | None
    ) -> None:
        self.env = env
        self.engine_id = engine_id
        self.profile = profile
        self.host = host
        self.waiting: collections.deque[Seq] = collections.deque()
        self.prefilling: list[Seq] = []  # admitted, prompt not done (arrival order)
        self.decoding: list[Seq] = []  # first token out, more to come
        self.busy_s = 0.0
        self.steps = 0
        self._wake: simpy.Event | None = None
        env.process(self._loop())

    def submit(self, seq: Seq) -> None:
        seq.arrived_s = self.env.now
        self.waiting.append(seq)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens submitted and not computed yet."""
        return sum(s.prefill_left for s in self.waiting) + sum(
            s.prefill_left for s in self.prefilling
        )

    def _loop(self) -> Generator[simpy.Event, object, None]:
        # the hot loop of every simulation: plain lists, no per-step rebuilds unless needed
        profile, env = self.profile, self.env
        while True:
            if not self.waiting and not self.prefilling and not self.decoding:
                self._wake = env.event()
                yield self._wake
                self._wake = None
            prefilling, decoding = self.prefilling, self.decoding
            while self.waiting and len(prefilling) + len(decoding) < profile.max_seqs:
                prefilling.append(self.waiting.popleft())
            budget = profile.max_batch_tokens - len(decoding)
            chunks: list[tuple[Seq, int]] = []
            tokens = 0
            for seq in prefilling:
                if budget <= 0:
                    break
                take = min(seq.prefill_left, budget)
                chunks.append((seq, take))
                budget -= take
                tokens += take
            step = profile.step_s(tokens, len(decoding))
            if self.host is not None:
                step *= self.host.slowdown(profile.threads)
                self.host.busy_threads += profile.threads
            yield env.timeout(step)
            if self.host is not None:
                self.host.busy_threads -= profile.threads
            self.busy_s += step
            self.steps += 1
            now = env.now
            finished = False
            for seq in decoding:  # never a first token here: that came with the prefill
                seq.output_left -= 1
                if not seq.output_left:
                    finished = True
                    if seq.on_done is not None:
                        seq.on_done(now)
            if finished:
                self.decoding = decoding = [s for s in decoding if s.output_left]
            done = 0
            for seq, take in chunks:
                seq.prefill_left -= take
                if not seq.prefill_left:
                    done += 1
                    seq.emit(now)
                    if seq.output_left:
                        decoding.append(seq)
            if done:  # prompts complete in arrival order: the done ones lead the list
                del prefilling[:done]
