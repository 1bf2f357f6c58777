"""The plan for one request: which engine prefills, which decodes, and how the KV moves.

Candidates are every healthy single engine that does both phases, and every pair of a
healthy engine that prefills and another that decodes (with room for the request's KV), both
on fabric nodes (a non-empty ``node_id``: the hand-off goes through the fabric).
Each gets the cost terms below; the chosen one is the fastest for an interactive request
(first token plus its longest output) and the cheapest in money for a batch one (so batch
decodes with long outputs land on the cheap classes, CPU decode included, and there too
when the GPU ones are full); ties go to the fewer currency units, then the fewer requests
running on the chosen engines (of equals, the least loaded), then the engine ids, so a plan
is a function of its inputs.

Terms (seconds unless named), all kept in :class:`Plan`:

* ``queue_s``: the prompt tokens queued on the prefill engine, at its prefill rate;
* ``pull_s``: moving the prefix another node holds beyond what the prefill engine's node
  holds, when moving it is faster than computing it (else it is computed);
* ``prefill_s``: the prompt tokens left uncached, at the prefill engine's rate;
* ``handoff_s``: for two engines on different nodes, the decode node's missing KV that is
  still in flight when prefill ends (``1 - overlap`` of it when the prefill engine pushes
  what it computes; all of it when the decode node pulls: nothing computed, or a prefill
  engine that does not push) plus the fixed cost of a hand-off
  (``handoff_fixed_s``, also kept as a term of its own); 0 on one engine;
* ``decode_s``: the request's longest output at the decode engine's rate;
* ``ttft_s`` = queue + pull + prefill + handoff; ``cost`` = (pull + prefill) at the prefill
  class's price + decode at the decode class's price, in currency units.

Conditional disaggregation falls out of the terms: a short prompt or a large hit on a single
engine makes the hand-off cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvfabric.sched.model import EngineState, HardwareProfile, Holdings, Link, Priority, Request

SINGLE, PUSH, PULL = "single", "push", "pull"


class NoEngineError(ValueError):
    """No healthy engine (or pair) can serve the request; the message says what is missing."""


@dataclass(frozen=True)
class Policy:
    """The scheduler's settings: hardware-class prices (a class not listed costs 0), the
    link between nodes, and the fixed cost of a prefill -> decode hand-off."""

    profiles: Mapping[str, HardwareProfile]
    link: Link
    handoff_fixed_s: float = 0.005

    def price(self, hardware_class: str) -> float:
        profile = self.profiles.get(hardware_class)
        return 0.0 if profile is None else profile.cost_per_hour / 3600.0


@dataclass(frozen=True)
class Plan:
    """Where a request runs, how its KV moves, and why (the terms of the choice)."""

    prefill_engine: str
    decode_engine: str
    mode: str  # single, push (prefill streams its KV to the decode node) or pull
    reused_tokens: int
    pulled_tokens: int
    terms: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""

    @property
    def ttft_s(self) -> float:
        return self.terms["ttft_s"]

    @property
    def cost(self) -> float:
        return self.terms["cost"]


def plan(
    request: Request, holdings: Holdings, engines: Sequence[EngineState], policy: Policy
) -> Plan:
    """The best plan for ``request`` (see the module docstring); NoEngineError when no
    healthy engine can prefill it or none has room to decode it."""
    healthy = [e for e in engines if e.healthy]
    prefillers = [e for e in healthy if e.role.prefills()]
    decoders = [
        e for e in healthy if e.role.decodes() and e.free_kv_tokens >= request.budget_tokens
    ]
    if not prefillers:
        raise NoEngineError("no healthy engine prefills")
    if not decoders:
        raise NoEngineError(f"no healthy engine has room to decode {request.budget_tokens} tokens")
    # one engine doing both phases is the pair of it with itself; a hand-off between two
    # engines goes through the fabric, so both must be on fabric nodes
    candidates = [
        _candidate(request, holdings, p, d, policy)
        for p in prefillers
        for d in decoders
        if p.engine_id == d.engine_id or (p.node_id and d.node_id)
    ]
    if not candidates:
        raise NoEngineError(
            "no engine does both phases, and the prefill and decode engines are not all on "
            "fabric nodes (node_id), through which a hand-off goes"
        )
    key = _by_latency if request.priority is Priority.INTERACTIVE else _by_cost
    best = min(candidates, key=key)
    goal = "latency" if request.priority is Priority.INTERACTIVE else "cost"
    return Plan(
        best.prefill_engine,
        best.decode_engine,
        best.mode,
        best.reused_tokens,
        best.pulled_tokens,
        best.terms,
        f"{best.mode}: best {goal} of {len(candidates)} candidate(s)",
    )


def _candidate(
    request: Request, holdings: Holdings, p: EngineState, d: EngineState, policy: Policy
) -> Plan:
    """The terms of prefilling on ``p`` and decoding on ``d`` (one engine when equal)."""
    same = p.engine_id == d.engine_id
    local = holdings.on(p.node_id)
    _, best = holdings.best()  # pulled from the longest holder (the fabric picks the copy)
    extra = max(0, min(best, request.prompt_tokens) - local)
    pulled = extra if extra and policy.link.seconds(extra) < extra / p.prefill_tps else 0
    reused = min(request.prompt_tokens, local + pulled)
    uncached = request.prompt_tokens - reused
    queue_s = p.queued_tokens / p.prefill_tps
    pull_s = policy.link.seconds(pulled)
    prefill_s = uncached / p.prefill_tps
    handoff_s = 0.0
    mode = SINGLE
    if not same:
        missing = max(0, request.prompt_tokens - holdings.on(d.node_id))
        if p.node_id == d.node_id:
            missing = 0
        mode = PUSH if uncached and p.pushes else PULL
        in_flight = missing if mode == PULL else missing * (1.0 - policy.link.overlap)
        handoff_s = policy.link.seconds(round(in_flight)) + policy.handoff_fixed_s
    decode_s = request.max_output_tokens / d.decode_tps
    ttft_s = queue_s + pull_s + prefill_s + handoff_s
    cost = (pull_s + prefill_s) * policy.price(p.hardware_class) + decode_s * policy.price(
        d.hardware_class
    )
    terms = {
        "running": float(p.running if same else p.running + d.running),
        "queue_s": queue_s,
        "pull_s": pull_s,
        "prefill_s": prefill_s,
        "handoff_s": handoff_s,
        "handoff_fixed_s": 0.0 if same else policy.handoff_fixed_s,
        "decode_s": decode_s,
        "ttft_s": ttft_s,
        "cost": cost,
    }
    return Plan(p.engine_id, d.engine_id, mode, reused, pulled, terms)


def _by_latency(plan: Plan) -> tuple[float, float, float, str, str]:
    latency = plan.ttft_s + plan.terms["decode_s"]
    return (latency, plan.cost, plan.terms["running"], plan.prefill_engine, plan.decode_engine)


def _by_cost(plan: Plan) -> tuple[float, float, float, str, str]:
    return (plan.cost, plan.ttft_s, plan.terms["running"], plan.prefill_engine, plan.decode_engine)
