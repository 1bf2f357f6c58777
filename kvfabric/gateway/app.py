"""The gateway's HTTP front door (FastAPI): OpenAI-compatible endpoints over the engines.

==============================  ==============================================================
endpoint                        what
==============================  ==============================================================
``POST /v1/completions``        an OpenAI / vLLM completion, streamed or not, placed by plan
``POST /v1/chat/completions``   the same for a chat (tokenized by an engine's ``/tokenize``)
``GET /v1/models``              the model the gateway serves
``POST /v1/plan``               the plan a completions- or chat-shaped body would get now,
``GET /v1/plan?prompt=..``      with its cost terms and the fabric's holdings (nothing runs)
``GET /v1/advice``              the P:D advice for the ingress seen (``advisor`` in config)
``GET /healthz``                200 while the process serves HTTP
``GET /readyz``                 200 while an engine is healthy, else 503
``GET /metrics``                Prometheus text (:mod:`kvfabric.gateway.metrics`)
==============================  ==============================================================

A request's way: who it is for (:mod:`.tenancy`: 401 / 400), its prompt's token ids (from
the body, or the engine's ``/tokenize``), one cluster lookup (:mod:`.holdings`; none while a
single engine is healthy: there is nothing to choose), admission
through the tenants' fair queue (:mod:`.admission`: 429 with ``Retry-After`` when its
tenant's queue is full, 503 when no engine could serve it), then the plan carried out
(:mod:`.dispatch`). The whole way is bounded by ``deadlines.request_s`` (504 past it).
Errors are JSON ``{"error": {"kind", "message"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfabric.api.body_limit import BodyLimit
from kvfabric.gateway import bodies
from kvfabric.gateway.admission import Admission
from kvfabric.gateway.advice import AdviceLoop
from kvfabric.gateway.config import GatewayConfig
from kvfabric.gateway.dispatch import Dispatcher, Job, error_body
from kvfabric.gateway.engines import EnginePool
from kvfabric.gateway.holdings import FabricView, Lookup
from kvfabric.gateway.metrics import GatewayMetrics
from kvfabric.gateway.tenancy import BadHeader, Caller, Unauthorized, identify
from kvfabric.gateway.upstream import TimedOut, Unreachable, Upstream
from kvfabric.sched.fair_queue import QueueFull
from kvfabric.sched.model import HardwareProfile, Holdings, Link
from kvfabric.sched.model import Request as SchedRequest
from kvfabric.sched.planner import NoEngineError, Plan, Policy

MAX_BODY_BYTES = 16 << 20
MAX_RETRY_AFTER_S = 600
DISCOVERY_INTERVAL_S = 5.0


class Gateway:
    """The gateway's parts, built from its config; :meth:`app` serves them."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.pool = EnginePool(config.engines, config.classes, self.metrics)
        spec = config.fabric.spec() if config.fabric else None
        kv_bytes = spec.layout(1).nbytes if spec else 0
        link = config.link
        self.policy = Policy(
            {n: HardwareProfile(n, c.cost_per_hour) for n, c in config.classes.items()},
            Link(link.bytes_per_s, kv_bytes, link.overlap),
            link.handoff_fixed_s,
        )
        self.admission = Admission(
            self.pool,
            self.policy,
            dict(config.tenants.weights),
            config.tenants.max_queued_tokens,
            self.metrics,
            isolation_slots=config.tenants.isolation_slots,
        )
        self.http = Upstream()
        self.fabric = (
            FabricView(
                self.http,
                config.fabric.url,
                config.fabric.model_id or config.model,
                spec,
                config.fabric.token,
                config.deadlines.connect_s,
            )
            if config.fabric and spec
            else None
        )
        self.advice = (
            AdviceLoop(
                config.advisor,
                config.classes,
                config.engines,
                self.pool.throughput,
                self.policy.link,
                self.metrics,
            )
            if config.advisor
            else None
        )
        self.dispatcher = Dispatcher(
            self.http,
            self.pool,
            self.metrics,
            config.deadlines.connect_s,
            self._served,
        )

    # -- a request's way -------------------------------------------------------------------

    async def completion(self, request: Request, path: str) -> Response:
        arrived = time.monotonic()
        deadline = arrived + self.config.deadlines.request_s
        try:
            caller = identify(request.headers, self.config.tenants.api_keys)
            body = await _json_body(request)
            self._check_model(body)
            tokens = await self._prompt_tokens(body, path, deadline)
            sched = SchedRequest(
                caller.tenant, len(tokens), bodies.max_output_tokens(body), caller.priority
            )
            lookup = await self._lookup(tokens, bodies.cache_salt(body), needed=self._choice())
        except Unauthorized as exc:
            return _error(401, "unauthorized", str(exc), {"WWW-Authenticate": "Bearer"})
        except (BadHeader, bodies.BadRequest) as exc:
            return _error(400, "bad_request", str(exc))
        except _Refused as exc:
            return exc.response
        tenant = self.metrics.tenant(caller.tenant)
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                plan = await self.admission.admit(sched, lookup.holdings)
        except QueueFull as full:
            self.metrics.rejected.labels(tenant, "queue_full").inc()
            retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(full.retry_after_s)))
            return _error(429, "queue_full", str(full), {"Retry-After": str(retry)})
        except NoEngineError as exc:
            self.metrics.rejected.labels(tenant, "no_engine").inc()
            return _error(503, "no_engine", str(exc))
        except TimeoutError:
            self.metrics.rejected.labels(tenant, "deadline").inc()
            return _error(504, "deadline", "the request's deadline passed in the queue")
        queued = time.monotonic() - arrived
        self.metrics.queue_wait.labels(tenant, caller.priority.value).observe(queued)
        self.metrics.decisions.labels(self.dispatcher.mode(plan), _goal(caller)).inc()
        job = Job(path, body, bool(body.get("stream")), sched, tenant, arrived, deadline, queued)
        return await self.dispatcher.serve(
            job, plan, lambda failed: self.admission.replan(sched, lookup.holdings, failed)
        )

    async def explain(self, request: Request) -> Response:
        """``/v1/plan``: the plan a body would get now (over healthy engines, room or not)."""
        try:
            caller = identify(request.headers, self.config.tenants.api_keys)
            if request.method == "GET":
                q = request.query_params
                body: dict[str, Any] = {"prompt": q.get("prompt", "")}
                if q.get("max_tokens"):
                    body["max_tokens"] = int(q["max_tokens"])
                path = bodies.COMPLETIONS
            else:
                body = await _json_body(request)
                path = bodies.CHAT if "messages" in body else bodies.COMPLETIONS
            tokens = await self._prompt_tokens(
                body, path, time.monotonic() + self.config.deadlines.request_s
            )
            sched = SchedRequest(
                caller.tenant, len(tokens), bodies.max_output_tokens(body), caller.priority
            )
            lookup = await self._lookup(tokens, bodies.cache_salt(body))
            chosen = self.admission.plan_now(sched, lookup.holdings)
        except Unauthorized as exc:
            return _error(401, "unauthorized", str(exc), {"WWW-Authenticate": "Bearer"})
        except (BadHeader, bodies.BadRequest, ValueError) as exc:
            kind = "no_engine" if isinstance(exc, NoEngineError) else "bad_request"
            return _error(503 if kind == "no_engine" else 400, kind, str(exc))
        except _Refused as exc:
            return exc.response
        return JSONResponse(
            {
                "plan": _plan_json(chosen, self.dispatcher.mode(chosen)),
                "prompt_tokens": len(tokens),
                "holdings": dict(lookup.holdings.tokens_by_node),
                "fabric_answered": lookup.ok,
                "tenant": caller.tenant,
                "priority": caller.priority.value,
            }
        )

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.setdefault("model", self.config.model)
        if model != self.config.model:
            raise _Refused(
                _error(404, "model_not_found", f"this gateway serves {self.config.model!r}")
            )

    async def _prompt_tokens(self, body: dict[str, Any], path: str, deadline: float) -> list[int]:
        ids = bodies.prompt_token_ids(body, path)
        if ids is not None:
            return ids
        started = time.monotonic()
        engines = [e for e in self.pool.engines.values() if e.healthy] or list(
            self.pool.engines.values()
        )
        tokenize_body = bodies.tokenize_body(body, path, self.config.model)
        for live in engines[:2]:  # one more engine when the first fails
            left = max(0.001, deadline - time.monotonic())
            try:
                answer = await self.http.post(
                    live.config.url.rstrip("/") + "/tokenize",
                    tokenize_body,
                    left,
                    min(left, self.config.deadlines.connect_s),
                )
            except (Unreachable, TimedOut):
                continue
            if answer.status >= 500:
                continue
            if answer.status >= 400:
                refused = Response(answer.body, answer.status, media_type=answer.content_type)
                raise _Refused(refused)
            self.metrics.phase.labels("tokenize").observe(time.monotonic() - started)
            try:
                return [int(t) for t in answer.json()["tokens"]]
            except (ValueError, KeyError, TypeError):
                continue
        raise _Refused(_error(502, "engine_failed", "no engine could tokenize the prompt"))

    def _choice(self) -> bool:
        """Whether holdings could change a plan: more than one healthy engine (with one, the
        lookup would only cost the request its round trip)."""
        return sum(e.healthy for e in self.pool.engines.values()) > 1

    async def _lookup(self, tokens: list[int], salt: str, *, needed: bool = True) -> Lookup:
        if self.fabric is None or not needed:
            return Lookup(Holdings(), True)
        started = time.monotonic()
        lookup = await self.fabric.lookup(tokens, salt)
        self.metrics.phase.labels("lookup").observe(time.monotonic() - started)
        self.metrics.lookups.labels("ok" if lookup.ok else "failed").inc()
        return lookup

    async def _discover(self) -> None:
        """Engines' hardware classes from the fabric's node registry, where left out."""
        if self.fabric is not None and self.pool.unresolved():
            classes = await self.fabric.node_classes()
            if classes is not None:
                self.pool.resolve_classes(classes)

    async def _keep_discovering(self, interval_s: float) -> None:
        while self.pool.unresolved():  # a node that joins later names its class then
            await asyncio.sleep(max(interval_s, DISCOVERY_INTERVAL_S))
            await self._discover()

    # -- the application -------------------------------------------------------------------

    def _served(self, prompt_tokens: int, output_tokens: int) -> None:
        self.admission.record_served(prompt_tokens + output_tokens)
        if self.advice is not None:
            self.advice.window.add(prompt_tokens, output_tokens)

    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            d = self.config.deadlines
            await self.http.start()
            await self._discover()
            await self.pool.check_all(self.http, d.connect_s)  # serve knowing who is up
            tasks = [
                asyncio.create_task(self._keep_discovering(d.health_interval_s)),
                asyncio.create_task(
                    self.pool.watch_health(self.http, d.health_interval_s, d.connect_s)
                ),
                asyncio.create_task(self.admission.pump()),
            ]
            if self.advice is not None:
                tasks.append(asyncio.create_task(self.advice.run()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.http.close()

        app = FastAPI(title="kvfabric gateway", lifespan=lifespan)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.completion(request, bodies.COMPLETIONS)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.completion(request, bodies.CHAT)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            model = {"id": self.config.model, "object": "model", "owned_by": "kvfabric"}
            return {"object": "list", "data": [model]}

        @app.get("/v1/plan")
        @app.post("/v1/plan")
        async def plan(request: Request) -> Response:
            return await self.explain(request)

        @app.get("/v1/advice")
        async def advice() -> Response:
            if self.advice is None:
                why = "no advisor: the gateway's config has no advisor section"
                return _error(404, "no_advisor", why)
            return JSONResponse(self.advice.json())

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/readyz")
        async def readyz() -> Response:
            engines = {
                e.id: {"healthy": e.healthy, "hardware_class": e.hardware_class}
                for e in self.pool.engines.values()
            }
            ready = self.pool.any_healthy()
            return JSONResponse(
                {"status": "ready" if ready else "not_ready", "engines": engines},
                status_code=200 if ready else 503,
            )

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
        return app


class _Refused(Exception):
    """A response that ends the request before it is queued."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise bodies.BadRequest("the body must be JSON") from None
    if not isinstance(body, dict):
        raise bodies.BadRequest("the body must be a JSON object")
    return body


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        error_body(kind, message),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def _goal(caller: Caller) -> str:
    return "latency" if caller.priority.value == "interactive" else "cost"


def _loop_time(deadline: float) -> float:
    """A monotonic deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


def _plan_json(plan: Plan, mode: str) -> dict[str, Any]:
    return {
        "prefill_engine": plan.prefill_engine,
        "decode_engine": plan.decode_engine,
        "mode": mode,
        "reused_tokens": plan.reused_tokens,
        "pulled_tokens": plan.pulled_tokens,
        "terms": dict(plan.terms),
        "reason": plan.reason,
    }
