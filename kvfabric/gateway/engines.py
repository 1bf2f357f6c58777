"""The engines the gateway sends phases to: their live state as the scheduler reads it.

Per engine the pool keeps what the gateway itself knows (requests in flight there, prompt
tokens sent and not yet prefilled; per tenant, the slots its requests hold) and what it
observes: health (``GET /health`` every ``health_interval_s``; a failed request marks the
engine down until it answers again) and measured prefill / decode rates
(:class:`kvfabric.sched.throughput.Throughput`, starting from the hardware class's prior).
:meth:`EnginePool.states` turns that into the :class:`~kvfabric.sched.model.EngineState`
values a plan is made of.

Owned by the gateway's event loop: every method runs on it (no locks).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvfabric.gateway.config import ClassConfig, EngineConfig
from kvfabric.gateway.metrics import GatewayMetrics
from kvfabric.gateway.upstream import TimedOut, Unreachable, Upstream
from kvfabric.sched.model import EngineState
from kvfabric.sched.throughput import ClassPrior, Throughput

log = logging.getLogger("kvfabric.gateway")
SLOW_CHECKS_DOWN = 3


@dataclass
class EngineLive:
    config: EngineConfig
    hardware_class: str | None = None  # configured, or found in the fabric's node registry
    healthy: bool = False  # until its first health check answers
    running: int = 0
    queued_tokens: int = 0

    @property
    def id(self) -> str:
        return self.config.id

    def has_room(self, extra_slots: int = 0) -> bool:
        return self.healthy and self.running < self.config.max_running + extra_slots


class EnginePool:
    def __init__(
        self,
        engines: Iterable[EngineConfig],
        classes: Mapping[str, ClassConfig],
        metrics: GatewayMetrics,
    ) -> None:
        self.engines = {e.id: EngineLive(e, e.hardware_class) for e in engines}
        self._classes = set(classes)
        self.throughput = Throughput(
            {name: ClassPrior(c.prefill_tps, c.decode_tps) for name, c in classes.items()}
        )
        self._metrics = metrics
        self.changed = asyncio.Event()  # set when room may have opened (the queue's pump)
        self._slow: dict[str, int] = {}  # health checks in a row that timed out, per engine
        self.held: collections.Counter[str] = collections.Counter()  # slots per tenant

    def __getitem__(self, engine_id: str) -> EngineLive:
        return self.engines[engine_id]

    def states(
        self, *, exclude: Iterable[str] = (), with_room: bool = True, extra_slots: int = 0
    ) -> list[EngineState]:
        """Engines a plan may name: healthy, not excluded, and (``with_room``) below their
        ``max_running`` + ``extra_slots``."""
        skip = set(exclude)
        out = []
        for live in self.engines.values():
            if live.id in skip or not live.healthy:
                continue
            if with_room and not live.has_room(extra_slots):
                continue
            hardware_class = live.hardware_class
            if hardware_class is None:  # its node has not told its class yet
                continue
            cfg = live.config
            out.append(
                EngineState(
                    engine_id=cfg.id,
                    node_id=cfg.node_id,
                    hardware_class=hardware_class,
                    role=cfg.role_value,
                    prefill_tps=self.throughput.rate(cfg.id, hardware_class, "prefill"),
                    decode_tps=self.throughput.rate(cfg.id, hardware_class, "decode"),
                    queued_tokens=live.queued_tokens,
                    running=live.running,
                    pushes=cfg.push,
                )
            )
        return out

    def unresolved(self) -> bool:
        """Whether an engine still waits for its node's class from the registry."""
        return any(e.hardware_class is None for e in self.engines.values())

    def resolve_classes(self, node_classes: Mapping[str, str]) -> None:
        """Engines without a configured class take their node's registered one (a class
        the gateway has no profile for leaves the engine out, said once)."""
        for live in self.engines.values():
            if live.config.hardware_class is not None:
                continue
            found = node_classes.get(live.config.node_id)
            if found in self._classes:
                if live.hardware_class != found:
                    log.info(
                        "engine %s: hardware class %s (node %s)",
                        live.id,
                        found,
                        live.config.node_id,
                    )
                    live.hardware_class = found
                    self.changed.set()
            elif found is not None and found != live.hardware_class:
                log.warning(
                    "engine %s: its node %s has hardware class %r, which the gateway's "
                    "classes do not list: the engine is left out",
                    live.id,
                    live.config.node_id,
                    found,
                )

    def any_healthy(self) -> bool:
        return any(e.healthy for e in self.engines.values())

    def capacity(self, extra_slots: int = 0) -> int:
        """The healthy engines' slots (``max_running`` + ``extra_slots`` each)."""
        return sum(e.config.max_running + extra_slots for e in self.engines.values() if e.healthy)

    def take(self, engine_id: str, prompt_tokens: int, tenant: str) -> None:
        live = self.engines[engine_id]
        live.running += 1
        self.held[tenant] += 1
        live.queued_tokens += prompt_tokens
        self._metrics.engine_running.labels(engine_id).set(live.running)

    def prefilled(self, engine_id: str, prompt_tokens: int) -> None:
        live = self.engines[engine_id]
        live.queued_tokens = max(0, live.queued_tokens - prompt_tokens)

    def give_back(self, engine_id: str, tenant: str) -> None:
        live = self.engines[engine_id]
        live.running = max(0, live.running - 1)
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        self._metrics.engine_running.labels(engine_id).set(live.running)
        self.changed.set()

    def mark(self, engine_id: str, healthy: bool) -> None:
        live = self.engines[engine_id]
        if live.healthy != healthy:
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "engine %s is %s",
                engine_id,
                "up" if healthy else "down",
            )
        live.healthy = healthy
        self._metrics.engine_healthy.labels(engine_id).set(1 if healthy else 0)
        if healthy:
            self.changed.set()

    async def check_all(self, http: Upstream, timeout_s: float) -> None:
        """One health round over every engine (the gateway's start waits for the first)."""
        await asyncio.gather(*(self._check(http, e, timeout_s) for e in self.engines.values()))

    async def watch_health(self, http: Upstream, interval_s: float, timeout_s: float) -> None:
        """Poll every engine's ``/health`` until cancelled. A refused connection or an error
        status marks an engine down at once; a slow answer (a busy engine on a loaded host)
        only after ``SLOW_CHECKS_DOWN`` in a row."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all(http, timeout_s)

    async def _check(self, http: Upstream, live: EngineLive, timeout_s: float) -> None:
        slow = self._slow
        try:
            answer = await http.get(live.config.url.rstrip("/") + "/health", timeout_s)
            ok = answer.status == 200
        except TimedOut:
            slow[live.id] = slow.get(live.id, 0) + 1
            if slow[live.id] >= SLOW_CHECKS_DOWN:
                self.mark(live.id, False)
            return
        except Unreachable:
            ok = False
        slow[live.id] = 0
        self.mark(live.id, ok)
