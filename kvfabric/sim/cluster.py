"""A simulated cluster: engines per hardware class, the fabric, links, and the gateway's
scheduling, driven by a workload (:func:`simulate`).

The scheduling is kvfabric's own, not a model of it: every request is planned by
:func:`kvfabric.sched.planner.plan` over the engines with room (the gateway's ``max_running``
slots), from what the simulated fabric holds of its prompt; when none has room it waits in
:class:`kvfabric.sched.fair_queue.FairQueue`, served in its order as slots free (as
:mod:`kvfabric.gateway.admission` does, without its isolation slots).

A plan is carried out as the gateway does: ``single`` (one engine: pull what another node
holds, read what this node holds on SSD, prefill the rest, decode); ``push`` / ``pull`` (the
prefill engine computes the prompt and one token; its KV reaches the decode node layer by
layer while it is computed (:func:`kvfabric.sim.overlap.layerwise`) when it pushes, or after
it when the decode node pulls; the decode engine then computes the last prompt token and the
output, and the client's first token is its first). An engine computes at least one prompt
token: the last one's KV is never reused, as in vLLM.

Deterministic: a cluster, a request list and nothing else decide the result (events at the
same time run in scheduling order).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field

import simpy

from kvfabric.sched.fair_queue import FairQueue
from kvfabric.sched.model import EngineState, HardwareProfile, Holdings, Link, Request, Role
from kvfabric.sched.planner import PULL, SINGLE, NoEngineError, Plan, Policy, plan
from kvfabric.sim.engine import EngineProfile, Host, Seq, SimEngine
from kvfabric.sim.fabric import FabricSpec, SimFabric
from kvfabric.sim.overlap import layerwise
from kvfabric.sim.results import RequestResult, SimResult
from kvfabric.sim.workload import SimRequest

UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its class (a key of the cluster's profiles), role, the fabric node beside
    it (default: its own id), the host whose cores it shares (default: none, its own) and
    the gateway's slots on it."""

    engine_id: str
    hardware_class: str
    role: Role = Role.BOTH
    node_id: str = ""
    host: str = ""
    max_running: int = UNBOUNDED
    pushes: bool = True
    on_fabric: bool = True  # off: no fabric node beside it (single plans only, no holdings)

    @property
    def node(self) -> str:
        return self.node_id or self.engine_id


@dataclass(frozen=True)
class ClusterSpec:
    engines: tuple[EngineSpec, ...]
    profiles: Mapping[str, EngineProfile]
    link: Link
    layers: int = 32  # the model's: layer-wise streaming sends one layer at a time
    handoff_fixed_s: float = 0.005
    hosts: Mapping[str, float] = field(default_factory=dict)  # cores per shared host
    fabric: FabricSpec = field(default_factory=FabricSpec)
    weights: Mapping[str, float] = field(default_factory=dict)  # tenants' fair-queue weights

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("a cluster needs engines")
        for e in self.engines:
            if e.hardware_class not in self.profiles:
                raise ValueError(f"engine {e.engine_id}: no profile for {e.hardware_class!r}")
            if e.host and e.host not in self.hosts:
                raise ValueError(f"engine {e.engine_id}: host {e.host!r} is not in hosts")

    def cost_per_hour(self) -> float:
        return sum(self.profiles[e.hardware_class].cost_per_hour for e in self.engines)


class CountingEnvironment(simpy.Environment):
    """A simpy environment that counts the events it schedules (the simulator's speed)."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduled = 0

    def schedule(self, event: simpy.Event, priority: int = 1, delay: float = 0) -> None:
        self.scheduled += 1
        super().schedule(event, priority, delay)  # type: ignore[arg-type]


def simulate(cluster: ClusterSpec, requests: Sequence[SimRequest]) -> SimResult:
    """Run every request of ``requests`` (arrival order) to completion."""
    started = time.perf_counter()
    run = _Run(cluster)
    run.env.process(run.arrivals(requests))
    run.env.run()
    if len(run.results) != len(requests):  # a request nobody could serve
        raise NoEngineError(f"{len(requests) - len(run.results)} request(s) were never served")
    results = tuple(sorted(run.results, key=lambda r: r.rid))
    return SimResult(
        requests=results,
        horizon_s=run.env.now,
        busy_s={i: e.busy_s for i, e in run.engines.items()},
        events=run.env.scheduled,
        wall_s=time.perf_counter() - started,
        cost_per_hour=cluster.cost_per_hour(),
        fabric_hits=dict(run.fabric.counters.hit_tokens),
    )


@dataclass
class _Job:
    request: SimRequest
    dispatched_s: float = 0.0
    first_s: float = -1.0
    plan: Plan | None = None
    landed_fraction: float = math.nan
    prefilled_s: float = math.nan


class _Run:
    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.env = CountingEnvironment()
        hosts = {name: Host(cores) for name, cores in cluster.hosts.items()}
        self.specs = {e.engine_id: e for e in cluster.engines}
        self.engines = {
            e.engine_id: SimEngine(
                self.env, e.engine_id, cluster.profiles[e.hardware_class], hosts.get(e.host)
            )
            for e in cluster.engines
        }
        self.slots = {e.engine_id: 0 for e in cluster.engines}
        kv_bytes = cluster.link.kv_bytes_per_token
        self.fabric = SimFabric(cluster.fabric, sorted({e.node for e in cluster.engines}), kv_bytes)
        self.policy = Policy(
            {n: HardwareProfile(n, p.cost_per_hour) for n, p in cluster.profiles.items()},
            cluster.link,
            cluster.handoff_fixed_s,
        )
        self.queue: FairQueue[_Job] = FairQueue(cluster.weights, UNBOUNDED)
        self.results: list[RequestResult] = []

    def arrivals(self, requests: Sequence[SimRequest]) -> Generator[simpy.Event, object, None]:
        for r in requests:
            if r.arrival_s > self.env.now:
                yield self.env.timeout(r.arrival_s - self.env.now)
            self.arrive(_Job(r))

    def arrive(self, job: _Job) -> None:
        request = _sched_request(job.request)
        if not len(self.queue) and self._try(job, request):
            return
        self.queue.push(request, job, 1.0)

    def pump(self) -> None:
        while (head := self.queue.peek()) is not None:
            request, job = head
            if not self._try(job, request):
                return
            self.queue.pop()

    def _try(self, job: _Job, request: Request) -> bool:
        r = job.request
        holdings = Holdings(self.fabric.holdings(r.group, r.shared_tokens))
        try:
            chosen = plan(request, holdings, self._states(), self.policy)
        except NoEngineError:
            return False
        job.plan, job.dispatched_s = chosen, self.env.now
        self.slots[chosen.prefill_engine] += 1
        if chosen.decode_engine != chosen.prefill_engine:
            self.slots[chosen.decode_engine] += 1
        self.env.process(self._carry_out(job, chosen))
        return True

    def _states(self) -> list[EngineState]:
        out = []
        for engine_id, spec in self.specs.items():
            if self.slots[engine_id] >= spec.max_running:
                continue
            engine = self.engines[engine_id]
            out.append(
                EngineState(
                    engine_id=engine_id,
                    node_id=spec.node if spec.on_fabric else "",
                    hardware_class=spec.hardware_class,
                    role=spec.role,
                    prefill_tps=engine.profile.prefill_tps,
                    decode_tps=engine.profile.decode_tps,
                    queued_tokens=engine.queued_tokens,
                    running=self.slots[engine_id],
                    pushes=spec.pushes,
                )
            )
        return out

    def _carry_out(self, job: _Job, chosen: Plan) -> Generator[simpy.Event, object, None]:
        r = job.request
        prefill = self.specs[chosen.prefill_engine]
        local = min(
            self.fabric.holdings(r.group, r.shared_tokens).get(prefill.node, 0), r.prompt_tokens
        )
        ssd_s = self.fabric.reuse(prefill.node, r.group, min(local, chosen.reused_tokens))
        fetch_s = chosen.terms["pull_s"] + ssd_s
        if fetch_s:
            yield self.env.timeout(fetch_s)
        uncached = max(1, r.prompt_tokens - chosen.reused_tokens)
        if chosen.mode == SINGLE:
            done = self.env.event()
            seq = Seq(uncached, r.output_tokens, lambda t: _first(job, t), _succeed(done))
            self.engines[prefill.engine_id].submit(seq)
            yield done
            self._finish(job, prefill.engine_id)
            return
        started = self.env.now
        prefilled = self.env.event()
        self.engines[prefill.engine_id].submit(Seq(uncached, 1, None, _succeed(prefilled)))
        yield prefilled
        job.prefilled_s = self.env.now
        self._store(prefill.node, r)
        self._release(prefill.engine_id)
        decode = self.specs[chosen.decode_engine]
        missing = (
            0
            if decode.node == prefill.node
            else r.prompt_tokens
            - self.fabric.holdings(r.group, r.shared_tokens).get(decode.node, 0)
        )
        kv_bytes = max(0, missing) * self.cluster.link.kv_bytes_per_token
        if chosen.mode == PULL:  # nothing moves before prefill ends
            handoff_s = kv_bytes / self.cluster.link.bytes_per_s + self.cluster.handoff_fixed_s
            job.landed_fraction = 0.0 if kv_bytes else 1.0
        else:
            streamed = layerwise(
                self.env.now - started,
                kv_bytes,
                self.cluster.layers,
                self.cluster.link.bytes_per_s,
                self.cluster.handoff_fixed_s,
            )
            handoff_s, job.landed_fraction = streamed.tail_s, streamed.landed_fraction
        if handoff_s:
            yield self.env.timeout(handoff_s)
        done = self.env.event()
        seq = Seq(1, r.output_tokens, lambda t: _first(job, t), _succeed(done))
        self.engines[decode.engine_id].submit(seq)
        yield done
        self._finish(job, decode.engine_id, stored=False)

    def _store(self, node: str, r: SimRequest) -> None:
        self.fabric.store(node, r.group, r.shared_tokens)

    def _release(self, engine_id: str) -> None:
        self.slots[engine_id] -= 1
        self.pump()

    def _finish(self, job: _Job, engine_id: str, stored: bool = True) -> None:
        r, chosen = job.request, job.plan
        assert chosen is not None
        if stored:
            self._store(self.specs[engine_id].node, r)
        self.results.append(
            RequestResult(
                rid=r.rid,
                tenant=r.tenant,
                priority=r.priority.value,
                phase=r.phase,
                arrival_s=r.arrival_s,
                dispatched_s=job.dispatched_s,
                first_s=job.first_s,
                done_s=self.env.now,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
                prefill_engine=chosen.prefill_engine,
                decode_engine=chosen.decode_engine,
                mode=chosen.mode,
                reused_tokens=chosen.reused_tokens,
                landed_fraction=job.landed_fraction,
                prefilled_s=job.first_s if chosen.mode == SINGLE else job.prefilled_s,
            )
        )
        self._release(engine_id)


def _succeed(event: simpy.Event) -> Callable[[float], None]:
    """A sequence's ``on_done`` that triggers ``event`` (a process waits on it)."""

    def done(now: float) -> None:
        event.succeed(now)

    return done


def _first(job: _Job, now: float) -> None:
    job.first_s = now


def _sched_request(r: SimRequest) -> Request:
    return Request(r.tenant, r.prompt_tokens, r.output_tokens, r.priority)
