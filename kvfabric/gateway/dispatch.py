"""Carrying out a plan: the engine calls of one request, its retry, its metrics.

A single-engine plan forwards the client's body to that engine. A P/D plan first asks the
prefill engine for one token with the hand-off (:func:`kvfabric.gateway.bodies.prefill_body`),
gives its slot back, then sends the client's body with the prefill answer's
``kv_transfer_params`` to the decode engine. Streams are passed through as the engine sends
them (server-sent events, byte for byte).

Failures. An engine that refuses the connection, times out before answering, or answers
5xx has not sent the client anything yet: it is marked down (until its health check passes
again) and the request is planned once more without it, at once, outside the queue
(``kvfabric_gateway_retries_total``). A second failure, or an engine that dies after a
stream began, ends the request with a clean error: 502 ``engine_failed``, or in a stream an
SSE event ``{"error": ...}`` then ``[DONE]``. An engine's 4xx is the client's problem: passed
through unchanged. Every engine call is bounded by what is left of the request's deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.responses import Response, StreamingResponse

from kvfabric.gateway.bodies import decode_body, prefill_body
from kvfabric.gateway.engines import EnginePool
from kvfabric.gateway.metrics import GatewayMetrics
from kvfabric.gateway.streams import StreamTally
from kvfabric.gateway.upstream import Answer, TimedOut, Unreachable, Upstream
from kvfabric.sched.model import Request
from kvfabric.sched.planner import SINGLE, Plan

log = logging.getLogger("kvfabric.gateway")
PUSH, PULL, LOCAL = "push", "pull", "local"
# a prefill of fewer computed tokens times the engine's fixed per-request cost, not its rate
MIN_PREFILL_SAMPLE_TOKENS = 512


class EngineFailed(Exception):
    def __init__(self, engine_id: str, why: str) -> None:
        super().__init__(f"engine {engine_id}: {why}")
        self.engine_id = engine_id


class DeadlinePassed(Exception):
    """The request's deadline passed while an engine worked on it."""


@dataclass
class Job:
    """One client request as the dispatcher serves it."""

    path: str
    body: dict[str, Any]
    stream: bool
    request: Request
    tenant_label: str
    arrived: float  # monotonic
    deadline: float  # monotonic
    queued_s: float = 0.0
    # prompt tokens counted in an engine's queued_tokens until its first token (or failure)
    pending: dict[str, int] = field(default_factory=dict)

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed
        return left


def error_body(kind: str, message: str) -> bytes:
    return json.dumps({"error": {"kind": kind, "message": message}}).encode()


class Dispatcher:
    def __init__(
        self,
        http: Upstream,
        pool: EnginePool,
        metrics: GatewayMetrics,
        connect_s: float,
        record_served: Callable[[int, int], None],
    ) -> None:
        self._http = http
        self._pool = pool
        self._metrics = metrics
        self._connect_s = connect_s
        self._record_served = record_served

    def mode(self, plan: Plan) -> str:
        """What the hand-off really is: single (one engine); local (both engines on one
        node: the decode engine loads from their daemon); push (planned so, the prefill
        engine being configured to push, and the decode engine has a node); else pull."""
        if plan.mode == SINGLE:
            return SINGLE
        prefill, decode = (
            self._pool[plan.prefill_engine].config,
            self._pool[plan.decode_engine].config,
        )
        if prefill.node_id and prefill.node_id == decode.node_id:
            return LOCAL
        return PUSH if plan.mode == PUSH and decode.node_id else PULL

    async def serve(self, job: Job, plan: Plan, replan: Callable[[str], Plan]) -> Response:
        """Carry out ``plan``; after an engine failure once more on ``replan(failed_id)``'s
        plan (NoEngineError: no other engine). Always a response, never an exception."""
        try:
            try:
                return await self._run(job, plan)
            except EngineFailed as failed:
                self._failed(job, failed)
                try:
                    second = replan(failed.engine_id)
                except ValueError:  # NoEngineError: nowhere else to go
                    return _error(502, "engine_failed", str(failed))
                self._metrics.decisions.labels(self.mode(second), "retry").inc()
                return await self._run(job, second)
        except EngineFailed as failed:
            self._failed(job, failed)
            return _error(502, "engine_failed", str(failed))
        except DeadlinePassed:
            self._metrics.rejected.labels(job.tenant_label, "deadline").inc()
            return _error(504, "deadline", "the request's deadline passed at an engine")
        except _ClientError as refused:
            answer = refused.response
            return Response(answer.body, status_code=answer.status, media_type=answer.content_type)

    def _failed(self, job: Job, failed: EngineFailed) -> None:
        log.warning("%s", failed)
        self._pool.mark(failed.engine_id, False)
        self._metrics.retries.labels(failed.engine_id).inc()

    async def _run(self, job: Job, plan: Plan) -> Response:
        """One attempt at ``plan``; its engines' slots (taken by admission) are given back
        here, or by the stream relay once a stream ends."""
        mode = self.mode(plan)
        headers = {
            "x-kvfabric-prefill": plan.prefill_engine,
            "x-kvfabric-decode": plan.decode_engine,
            "x-kvfabric-mode": mode,
            "x-kvfabric-queue-ms": f"{job.queued_s * 1000:.3f}",
        }
        prefill_held = plan.mode != SINGLE
        decode_held = True
        job.pending = {plan.prefill_engine: job.request.prompt_tokens - plan.reused_tokens}
        try:
            body = job.body
            if prefill_held:
                push_to = self._pool[plan.decode_engine].config.node_id if mode == PUSH else None
                params = await self._prefill(job, plan, push_to)
                self._pool.give_back(plan.prefill_engine, job.request.tenant)
                prefill_held = False
                body = decode_body(job.body, params)
            if job.stream:
                sent = time.monotonic()
                upstream = await self._open_stream(plan.decode_engine, job, body)
                decode_held = False  # the relay gives it back when the stream ends
                return StreamingResponse(
                    self._relay(job, plan, upstream, sent),
                    status_code=upstream.status,
                    headers=headers,
                    media_type=upstream.headers.get("Content-Type", "text/event-stream"),
                )
            return await self._complete(job, plan, body, headers)
        finally:
            if decode_held:  # else the relay settles them
                for engine_id in list(job.pending):
                    self._prefilled(job, engine_id)
            if prefill_held:
                self._pool.give_back(plan.prefill_engine, job.request.tenant)
            if decode_held:
                self._pool.give_back(plan.decode_engine, job.request.tenant)

    def _prefilled(self, job: Job, engine_id: str) -> None:
        tokens = job.pending.pop(engine_id, 0)
        if tokens:
            self._pool.prefilled(engine_id, tokens)

    # -- phases ----------------------------------------------------------------------------

    async def _prefill(self, job: Job, plan: Plan, push_to: str | None) -> dict[str, Any] | None:
        started = time.monotonic()
        response = await self._post(plan.prefill_engine, job, prefill_body(job.body, push_to))
        if response.status >= 400:
            raise _ClientError(response)
        elapsed = time.monotonic() - started
        self._metrics.phase.labels("prefill").observe(elapsed)
        uncached = job.request.prompt_tokens - plan.reused_tokens
        self._prefilled(job, plan.prefill_engine)
        if _measures_prefill(plan, uncached):
            self._pool.throughput.observe(plan.prefill_engine, "prefill", uncached, elapsed)
        params = _field(response, "kv_transfer_params")
        return params if isinstance(params, dict) else None

    async def _complete(
        self, job: Job, plan: Plan, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        started = time.monotonic()
        response = await self._post(plan.decode_engine, job, body)
        now = time.monotonic()
        self._prefilled(job, plan.decode_engine)
        self._metrics.phase.labels("decode").observe(now - started)
        if response.status < 400:
            self._metrics.ttft.labels(job.tenant_label, job.request.priority.value).observe(
                now - job.arrived
            )
            usage = _field(response, "usage")
            usage = usage if isinstance(usage, dict) else {}
            output = int(usage.get("completion_tokens", 0))
            if plan.mode != SINGLE and output:
                self._pool.throughput.observe(plan.decode_engine, "decode", output, now - started)
            self._served(job, int(usage.get("prompt_tokens", job.request.prompt_tokens)), output)
        return Response(
            response.body,
            status_code=response.status,
            headers=headers,
            media_type=response.content_type,
        )

    async def _relay(
        self, job: Job, plan: Plan, upstream: aiohttp.ClientResponse, sent: float
    ) -> AsyncIterator[bytes]:
        """The engine's stream to the client; the decode slot is given back at its end (a
        stream cut short, by the client or the deadline, closes the engine's connection:
        vLLM aborts a request whose client is gone). After a hand-off (the decode request
        ``sent`` then), its first token measures the hand-off's fixed cost: the wait past
        the transfer the plan modelled."""
        first = last = 0.0
        tally = StreamTally()
        whole = False
        try:
            async for chunk in upstream.content.iter_any():
                now = time.monotonic()
                if not first:
                    first = now
                    self._metrics.ttft.labels(job.tenant_label, job.request.priority.value).observe(
                        now - job.arrived
                    )
                    self._prefilled(job, plan.decode_engine)
                    uncached = job.request.prompt_tokens - plan.reused_tokens
                    if plan.mode == SINGLE and _measures_prefill(plan, uncached):
                        took = now - (job.arrived + job.queued_s)  # first token ends prefill
                        self._pool.throughput.observe(plan.decode_engine, "prefill", uncached, took)
                    elif plan.mode != SINGLE:
                        transfer = plan.terms["handoff_s"] - plan.terms["handoff_fixed_s"]
                        self._pool.throughput.observe_handoff(now - sent - transfer)
                last = now
                tally.feed(chunk)
                yield chunk
                if now > job.deadline:
                    yield _sse_error("deadline", "the request's deadline passed")
                    return
            whole = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._pool.mark(plan.decode_engine, False)
            self._metrics.rejected.labels(job.tenant_label, "engine_failed").inc()
            why = str(exc) or type(exc).__name__
            yield _sse_error("engine_failed", f"engine {plan.decode_engine} failed: {why}")
            return
        finally:
            if whole:
                upstream.release()
            else:
                upstream.close()
            self._prefilled(job, plan.decode_engine)
            self._pool.give_back(plan.decode_engine, job.request.tenant)
        output = tally.output_tokens()
        steps = tally.tokens  # events carrying output: the first at `first`
        if steps > 1 and last > first:
            self._metrics.tpot.labels(job.tenant_label, job.request.priority.value).observe(
                (last - first) / (steps - 1)
            )
            self._pool.throughput.observe(plan.decode_engine, "decode", steps - 1, last - first)
        self._metrics.phase.labels("decode").observe(last - (first or last))
        usage = tally.usage or {}
        prompt = usage.get("prompt_tokens")
        self._served(job, prompt if isinstance(prompt, int) else job.request.prompt_tokens, output)

    # -- engine calls ----------------------------------------------------------------------

    def _url(self, engine_id: str, job: Job) -> str:
        return self._pool[engine_id].config.url.rstrip("/") + job.path

    async def _post(self, engine_id: str, job: Job, body: dict[str, Any]) -> Answer:
        left = job.left()
        with _engine_call(engine_id, job):
            answer = await self._http.post(
                self._url(engine_id, job), body, left, min(self._connect_s, left)
            )
        if answer.status >= 500:
            raise EngineFailed(engine_id, f"answered {answer.status}")
        return answer

    async def _open_stream(
        self, engine_id: str, job: Job, body: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        left = job.left()
        with _engine_call(engine_id, job):
            response = await self._http.open_stream(
                self._url(engine_id, job), body, left, min(self._connect_s, left)
            )
        if response.status >= 400:
            try:
                content = await response.read()
            except (aiohttp.ClientError, TimeoutError):
                content = b""
            finally:
                response.release()
            if response.status >= 500:
                raise EngineFailed(engine_id, f"answered {response.status}")
            raise _ClientError(Answer(response.status, response.content_type, content))
        return response

    def _served(self, job: Job, prompt_tokens: int, output_tokens: int) -> None:
        self._metrics.served_tokens.labels(job.tenant_label).inc(prompt_tokens + output_tokens)
        self._record_served(prompt_tokens, output_tokens)


def _measures_prefill(plan: Plan, uncached: int) -> bool:
    """Whether a phase's time is a sample of its engine's prefill rate: enough computed
    tokens that the engine's fixed cost per request does not dominate, and nothing pulled
    (a pull's time is the link's, not the engine's)."""
    return uncached >= MIN_PREFILL_SAMPLE_TOKENS and not plan.pulled_tokens


@contextlib.contextmanager
def _engine_call(engine_id: str, job: Job) -> Iterator[None]:
    """An engine call's failures as the dispatcher's: past the request's deadline, or the
    engine failed (timed out before it, refused, dropped)."""
    try:
        yield
    except TimedOut:
        if time.monotonic() >= job.deadline:
            raise DeadlinePassed from None
        raise EngineFailed(engine_id, "timed out") from None
    except Unreachable as exc:
        raise EngineFailed(engine_id, str(exc)) from None


class _ClientError(Exception):
    """An engine's 4xx answer: the request's own fault, passed to the client unchanged."""

    def __init__(self, response: Answer) -> None:
        super().__init__(response.status)
        self.response = response


def _field(answer: Answer, name: str) -> object:
    """A top-level field of an engine's JSON answer (None when absent or not JSON)."""
    try:
        body = answer.json()
    except ValueError:
        return None
    return body.get(name) if isinstance(body, dict) else None


def _error(status: int, kind: str, message: str) -> Response:
    return Response(error_body(kind, message), status_code=status, media_type="application/json")


def _sse_error(kind: str, message: str) -> bytes:
    return b"data: " + error_body(kind, message) + b"\n\ndata: [DONE]\n\n"
