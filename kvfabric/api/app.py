"""The daemon's HTTP API (FastAPI): KV-hit lookups for routers, stats, admin, /metrics.

``create_app(daemon)`` serves one daemon (any object shaped like :class:`DaemonView`):

==============================  =================  ============================================
endpoint                        who (auth on)      what
==============================  =================  ============================================
``GET /healthz``                anyone             200 while the process serves HTTP (plus
                                                   ``warnings``: planes exposed insecurely)
``GET /readyz``                 anyone             200 when ``daemon.ready``, else 503; both
                                                   say ``degraded`` (and which tiers) while a
                                                   disk fault degrades the SSD tier
``GET /metrics``                admin              Prometheus text exposition (its tenant
                                                   labels would show tenants each other)
``POST /v1/lookup``             admin, tenants     longest stored prefix of a prompt or chain
                                (own tenant only)  (``scope: cluster``: also per-node prefixes
                                                   from the global index, and ``stale``)
``GET /v1/nodes``               admin, tenants     the cluster's live nodes and their hardware
                                                   classes (this node alone without an index)
``GET /v1/stats``               admin              tiers, totals, namespaces, node
``GET /v1/transfers/recent``    admin              the last KV moves (``limit``, newest first;
                                                   :mod:`kvfabric.api.transfers`)
``GET /ui``                     anyone             the status page (static; it reads the
                                                   endpoints above with the caller's token:
                                                   :mod:`kvfabric.api.ui`)
``POST /v1/admin/evict``        admin              ``store.evict(tier, bytes)``
``POST /v1/admin/flush``        admin              ``store.flush()`` (waits for SSD writes)
==============================  =================  ============================================

Authentication is on when ``config.auth`` has an admin token or tenant tokens:
``Authorization: Bearer <token>``, compared in constant time. No or an unknown token: 401
(``WWW-Authenticate: Bearer``); a known token outside its rights: 403.

Errors are JSON ``{"error": {"kind", "message"}}``: body validation 422 (plus ``detail``, the
first few pydantic issues, never echoing the input), kvfabric errors by kind (401
unauthorized, 403 forbidden, 404 not_found, 503 unavailable, 504 deadline, 500 internal or
bad_config, 400 any other). Bodies over ``max_body_bytes`` are refused with 413 before they
are parsed; a lookup's token ids are counted before any is validated (over
``config.limits.lookup_max_tokens``: 413, kind ``too_large``) and its body is parsed on a
worker thread (:mod:`kvfabric.api.lookup_body`), never on the event loop; a large one in a
worker process (:mod:`kvfabric.api.lookup_workers`, ``limits.http_parse_workers``), so that
it costs the daemon's own process neither CPU nor the GIL.

Endpoints that touch the store are plain ``def``: FastAPI runs them in its threadpool, so a
lookup waiting on the store lock or a flush waiting on SSD writes never blocks the event
loop. Every ``/v1`` request is recorded as ``observe_request(op, ..., plane="http")``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, Self

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, model_validator
from starlette.exceptions import HTTPException

from kvfabric import __version__
from kvfabric.api.body_limit import BodyLimit
from kvfabric.api.lookup_body import BodyInvalid, BodyTooLarge
from kvfabric.api.lookup_workers import LookupParsers
from kvfabric.api.metrics import Metrics, error_kind
from kvfabric.api.stats_body import DEGRADED as _DEGRADED
from kvfabric.api.stats_body import StatsResponse, stats_response
from kvfabric.api.transfers import RecentTransfers, TransferKind
from kvfabric.api.ui import page_response
from kvfabric.auth import Principal, resolve
from kvfabric.cluster.index import GlobalLookup, NodePrefixRow
from kvfabric.config import DaemonConfig
from kvfabric.errors import (
    AuthError,
    ConfigError,
    DeadlineExceededError,
    ForbiddenError,
    KVFabricError,
    NotFoundError,
    ProtocolError,
    UnavailableError,
)
from kvfabric.hashing import KEY_BYTES, chunk_keys
from kvfabric.logfmt import add_context, request_context
from kvfabric.protocol.messages import MAX_KEYS, MAX_STRING, MAX_TOKENS, decode_namespace
from kvfabric.spec import (
    DEFAULT_CHUNK_TOKENS,
    MAX_CHUNK_TOKENS,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    KVDtype,
    Namespace,
)

if TYPE_CHECKING:
    from kvfabric.store.protocol import Store

# The largest valid body: MAX_TOKENS ids of up to 11 characters ("-2147483648") with a
# separator and some whitespace each, plus the namespace.
MAX_BODY_BYTES = 16 * MAX_TOKENS + (1 << 20)
MAX_REPORTED_ISSUES = 10
DEFAULT_TRANSFERS, MAX_TRANSFERS = 50, 1000


class ClusterView(Protocol):
    """The daemon's link to the global index, as far as the API needs it."""

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> GlobalLookup: ...
    def node_prefixes(
        self, ns: Namespace, keys: Sequence[bytes]
    ) -> tuple[list[NodePrefixRow], bool]: ...
    def hardware_classes(self) -> dict[str, str]: ...  # live node id -> hardware class


class DaemonView(Protocol):
    """What the API needs from the daemon."""

    @property
    def config(self) -> DaemonConfig: ...
    @property
    def store(self) -> Store: ...  # an InstrumentedStore (or a TieredStore)
    @property
    def metrics(self) -> Metrics: ...
    @property
    def node_id(self) -> str: ...
    @property
    def ready(self) -> bool: ...
    @property
    def started_at(self) -> float: ...  # time.time() at start
    @property
    def session_count(self) -> int: ...
    @property
    def cluster(self) -> ClusterView | None: ...  # None: no global index (scope cluster: 503)


# ---------------------------------------------------------------------- request bodies

_STRICT = ConfigDict(extra="forbid", strict=True)
TokenId = Annotated[int, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
ChunkHash = Annotated[str, StringConstraints(pattern=rf"^[0-9a-fA-F]{{{2 * KEY_BYTES}}}$")]


class SpecBody(BaseModel):
    """KVSpec fields (see :class:`kvfabric.spec.KVSpec`)."""

    model_config = _STRICT
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    num_kv_heads: int = Field(gt=0, le=MAX_KV_HEADS)
    head_dim: int = Field(gt=0, le=MAX_HEAD_DIM)
    dtype: str = Field(
        KVDtype.BFLOAT16.value,
        max_length=32,
        description=f"one of {[d.value for d in KVDtype]} (or an alias)",
    )
    kind: Literal["mha", "mla"] = "mha"
    chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, gt=0, le=MAX_CHUNK_TOKENS)


class NamespaceBody(BaseModel):
    """A namespace as on the control protocol; validated into a :class:`Namespace`."""

    model_config = _STRICT
    model: str = Field(min_length=1, max_length=MAX_STRING)
    spec: SpecBody
    tenant: str = Field("", max_length=MAX_STRING)
    lora: str = Field("", max_length=MAX_STRING)
    _namespace: Namespace = PrivateAttr()

    @model_validator(mode="after")
    def _decode(self) -> Self:
        # Cross-field spec rules (MLA has one head, dtype aliases) live in KVSpec; its
        # ProtocolError is a ValueError, so pydantic reports it as a 422 like any other.
        self._namespace = decode_namespace(self.model_dump())
        return self

    @property
    def value(self) -> Namespace:
        return self._namespace


class LookupRequest(BaseModel):
    model_config = _STRICT
    namespace: NamespaceBody
    token_ids: list[TokenId] | None = Field(
        None, max_length=MAX_TOKENS, description="a prompt; only its full chunks are looked up"
    )
    chunk_hashes: list[ChunkHash] | None = Field(
        None, max_length=MAX_KEYS, description="a chain of chunk keys, hex, root first"
    )
    scope: Literal["local", "cluster"] = Field(
        "local", description="cluster: also which nodes hold the prefix (global index)"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        if (self.token_ids is None) == (self.chunk_hashes is None):
            raise ValueError("give exactly one of token_ids and chunk_hashes")
        return self


class EvictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    tier: str | None = Field(None, max_length=64, description="one tier; null: from the last up")
    nbytes: int | None = Field(
        None, alias="bytes", gt=0, description="stop once this many bytes are freed; null: all"
    )


# ---------------------------------------------------------------------- responses


class ErrorBody(BaseModel):
    kind: str
    message: str


class Issue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(BaseModel):
    error: ErrorBody
    detail: list[Issue] | None = None


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded"] = "ok"
    node_id: str
    uptime_s: float
    degraded: list[str] = Field(default_factory=list, description=_DEGRADED)
    warnings: list[str] = Field(
        default_factory=list,
        description="planes listening beyond "
        "loopback without authentication (security.allow_insecure)",
    )


class ReadyResponse(BaseModel):
    status: Literal["ready", "degraded", "not_ready"]
    node_id: str
    degraded: list[str] | None = Field(None, description=_DEGRADED + " (still ready: 200)")
    reason: str | None = Field(None, description="why not ready")


class NodePrefixBody(BaseModel):
    node_id: str
    epoch: int
    chunks: int = Field(description="leading chunks of the chain this node holds")
    tier_chunks: dict[str, int] = Field(description="of those, how many per tier")
    hardware_class: str = Field(
        description="the node's declared hardware class (cluster.hardware_class), for routing"
    )


class LookupResponse(BaseModel):
    matched_tokens: int
    matched_chunks: int
    requested_chunks: int
    requested_tokens: int | None = Field(description="prompt length (token_ids only)")
    chunk_tokens: int
    tiers: dict[str, int] = Field(description="matched tokens per tier")
    nodes: list[NodePrefixBody] | None = Field(
        default=None, description="scope cluster: live nodes holding a prefix of the chain"
    )
    stale: bool | None = Field(
        default=None,
        description="scope cluster: the global view may lag (index unreachable or "
        "not yet republished)",
    )


class NodeBody(BaseModel):
    node_id: str
    hardware_class: str = Field(description="the node's cluster.hardware_class")


class NodesResponse(BaseModel):
    nodes: list[NodeBody] = Field(description="live nodes of the node registry, by id")
    cluster: bool = Field(description="false: no global index; this node alone")


class TransferBody(BaseModel):
    seq: int = Field(description="1 for the daemon's first transfer, then consecutive")
    at: float = Field(description="unix time it was recorded (when it ended)")
    kind: TransferKind = Field(
        description="get/put: an engine's read or write through shared memory; serve: "
        "chunks pinned for another node's puller; pull/push: chunks copied from/to a node"
    )
    peer: str = Field(description="the engine's client name, or the other node")
    chunks: int
    nbytes: int | None = Field(serialization_alias="bytes", description="null: not known")
    tokens: int | None = Field(description="null: not known")
    failed: int = Field(description="chunks asked for but not moved (pull, push)")
    seconds: float | None = Field(description="pull, push: the daemon's own move")


class TransfersResponse(BaseModel):
    transfers: list[TransferBody] = Field(description="newest first")
    recorded: int = Field(description="transfers recorded since start, dropped ones included")
    capacity: int = Field(description="how many the daemon keeps")


class EvictResponse(BaseModel):
    evicted: int


class FlushResponse(BaseModel):
    flushed: bool


# ---------------------------------------------------------------------- auth


_bearer = HTTPBearer(auto_error=False, description="the admin token or a tenant token")


async def _daemon(request: Request) -> DaemonView:
    return request.app.state.daemon  # type: ignore[no-any-return]


Daemon = Annotated[DaemonView, Depends(_daemon)]


def _caller(
    daemon: Daemon, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    # Plain def: reading auth.token_file (re-read per request, so it can be rotated) is I/O.
    # The header's bytes, as Starlette decoded them (latin-1).
    raw = None if credentials is None else credentials.credentials.encode("latin-1")
    principal = resolve(daemon.config.auth, raw)
    if principal is None:
        if credentials is None:
            raise AuthError("missing bearer token (Authorization: Bearer <token>)")
        raise AuthError("invalid bearer token")
    return principal


Caller = Annotated[Principal, Depends(_caller)]


async def _admin(caller: Caller) -> Principal:
    if not caller.is_admin:
        raise ForbiddenError("this endpoint needs the admin token")
    return caller


Admin = Annotated[Principal, Depends(_admin)]


# ---------------------------------------------------------------------- errors

_STATUS: dict[type[KVFabricError], int] = {
    AuthError: 401,
    ForbiddenError: 403,
    NotFoundError: 404,
    UnavailableError: 503,
    DeadlineExceededError: 504,
    ConfigError: 500,
}


def _status_of(exc: KVFabricError) -> int:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500 if exc.kind == KVFabricError.kind else 400


def _error_json(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        {"error": {"kind": kind, "message": message}, **extra}, status, headers=headers
    )


async def _on_kvfabric_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, KVFabricError)
    return _error_json(_status_of(exc), exc.kind, str(exc))


async def _on_validation_error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, BodyInvalid):
        errors, total = exc.issues, exc.total
    else:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors())
        total = len(errors)
    # Never echo the input back: it may be millions of token ids.
    issues = [
        {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in errors[:MAX_REPORTED_ISSUES]
    ]
    message = "; ".join(f"{'.'.join(map(str, i['loc']))}: {i['msg']}" for i in issues)
    if total > MAX_REPORTED_ISSUES:
        message += f"; and {total - MAX_REPORTED_ISSUES} more"
    return _error_json(422, ProtocolError.kind, message, detail=issues)


async def _on_too_large(_: Request, exc: Exception) -> Response:
    return _error_json(413, TOO_LARGE, str(exc))


TOO_LARGE = "too_large"  # the kind BodyLimit answers with too


def _kind_of(exc: Exception) -> str:
    if isinstance(exc, (RequestValidationError, BodyInvalid)):
        return ProtocolError.kind
    if isinstance(exc, BodyTooLarge):
        return TOO_LARGE
    if isinstance(exc, HTTPException):
        return f"http_{exc.status_code}"
    return error_kind(exc)


class _ObservedRoute(APIRoute):
    """A route whose every request is recorded in the daemon's request metrics."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        op = self.name

        async def observed(request: Request) -> Response:
            started = time.perf_counter()
            kind = None
            try:
                # its log lines carry the op and X-Request-ID (kvfabric.logfmt)
                with request_context(op=op, request_id=request.headers.get("x-request-id")):
                    return await handler(request)
            except Exception as exc:
                kind = _kind_of(exc)
                raise
            finally:
                request.app.state.daemon.metrics.observe_request(
                    op, time.perf_counter() - started, kind, plane="http"
                )

        return observed


# ---------------------------------------------------------------------- endpoints

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "a kvfabric error"),
        (401, "missing or unknown token"),
        (403, "token not allowed here"),
        (413, "body or list over its limit"),
        (422, "invalid body"),
    )
}

_probes = APIRouter(tags=["probes"])
_ui = APIRouter(tags=["ui"])
_scrape = APIRouter(tags=["metrics"])
_api = APIRouter(prefix="/v1", route_class=_ObservedRoute, responses=_ERRORS)


def _uptime(daemon: DaemonView) -> float:
    return max(0.0, time.time() - daemon.started_at)


def _warnings(daemon: DaemonView) -> list[str]:
    return list(getattr(daemon, "warnings", ()))


@_probes.get("/healthz")
async def healthz(daemon: Daemon) -> HealthResponse:
    degraded = daemon.store.degraded_tiers  # lock-free: fine on the event loop
    return HealthResponse(
        status="degraded" if degraded else "ok",
        node_id=daemon.node_id,
        uptime_s=_uptime(daemon),
        warnings=_warnings(daemon),
        degraded=degraded,
    )


@_probes.get(
    "/readyz",
    response_model_exclude_none=True,
    responses={503: {"model": ReadyResponse, "description": "not ready"}},
)
async def readyz(daemon: Daemon, response: Response) -> ReadyResponse:
    ready = daemon.ready
    if not ready:  # starting, draining before shutdown, or a plane stopped accepting
        response.status_code = 503
    # a degraded SSD tier still serves (memory, and reads of what it holds): ready, but said
    degraded = daemon.store.degraded_tiers or None
    status: Literal["ready", "degraded", "not_ready"] = (
        "not_ready" if not ready else "degraded" if degraded else "ready"
    )
    return ReadyResponse(
        status=status,
        node_id=daemon.node_id,
        degraded=degraded,
        reason=None if ready else getattr(daemon, "not_ready_reason", None),
    )


@_scrape.get(
    "/metrics",
    response_class=Response,
    responses=_ERRORS
    | {200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
def metrics(daemon: Daemon, _: Admin) -> Response:
    body, content_type = daemon.metrics.render()  # reads store.stats(): takes the store lock
    return Response(body, media_type=content_type)


# exclude_unset: the cluster fields appear only when scope is cluster. The body is read raw
# and parsed off the loop (kvfabric.api.lookup_workers); its schema is added by _openapi.
# The answer is serialized here, not validated again by FastAPI against the response model
# (that doubled the endpoint's own time); the model still documents it.
@_api.post("/lookup", name="lookup", response_model=LookupResponse)
async def lookup(request: Request, daemon: Daemon, caller: Caller) -> Response:
    raw = await request.body()  # at most max_body_bytes: BodyLimit
    parsers: LookupParsers = request.app.state.lookup_parsers
    # parsed and answered on one worker thread (a large body parsed in a worker process)
    answer = await parsers.run(raw, LookupRequest, lambda body: _lookup(body, daemon, caller))
    return Response(answer.model_dump_json(exclude_unset=True), media_type="application/json")


def _lookup(body: LookupRequest, daemon: DaemonView, caller: Principal) -> LookupResponse:
    ns = body.namespace.value
    add_context(namespace=ns.model_id, tenant=caller.tenant or ns.tenant_salt or None)
    caller.check_namespace(ns)
    nodes: list[NodePrefixRow] | None = None
    stale, peer_chunks = False, 0
    hashes = None if body.chunk_hashes is None else [bytes.fromhex(h) for h in body.chunk_hashes]
    if body.scope == "cluster":  # first: the store counts what other nodes hold as peer hits
        if daemon.cluster is None:
            raise UnavailableError("this server has no global index")
        keys = (
            chunk_keys(ns, body.token_ids, include_partial=False)
            if body.token_ids is not None
            else hashes or []
        )
        nodes, stale = daemon.cluster.node_prefixes(ns, keys)
        peer_chunks = max((n["chunks"] for n in nodes if n["node_id"] != daemon.node_id), default=0)
    peer = {"peer_chunks": peer_chunks} if peer_chunks else {}
    if body.token_ids is not None:
        result = daemon.store.lookup_tokens(ns, body.token_ids, **peer)
        requested_tokens: int | None = len(body.token_ids)
    else:
        assert hashes is not None
        result = daemon.store.lookup(ns, hashes, **peer)
        requested_tokens = None
    response = LookupResponse(
        matched_tokens=result.matched_tokens,
        matched_chunks=result.matched_chunks,
        requested_chunks=result.requested_chunks,
        requested_tokens=requested_tokens,
        chunk_tokens=ns.spec.chunk_tokens,
        tiers=result.tier_tokens,
    )
    if nodes is not None:
        response.stale = stale
        response.nodes = [NodePrefixBody(**node) for node in nodes]
    return response


@_api.get("/stats", name="stats", response_model=StatsResponse)
def stats(daemon: Daemon, _: Admin) -> BaseModel:
    return stats_response(
        daemon.store.stats(),
        node_id=daemon.node_id,
        uptime_s=_uptime(daemon),
        ready=daemon.ready,
        sessions=daemon.session_count,
        warnings=_warnings(daemon),
    )


@_api.get("/transfers/recent", name="transfers")
def transfers_recent(
    daemon: Daemon,
    _: Admin,
    limit: Annotated[int, Query(ge=1, le=MAX_TRANSFERS)] = DEFAULT_TRANSFERS,
) -> TransfersResponse:
    """The last KV moves of this node (admin only: they name every tenant's engines)."""
    recorder = getattr(daemon, "transfers", None)  # a view without one: nothing recorded
    if not isinstance(recorder, RecentTransfers):
        return TransfersResponse(transfers=[], recorded=0, capacity=0)
    kept, recorded = recorder.recent(limit)
    rows = [
        TransferBody(
            seq=t.seq,
            at=t.at,
            kind=t.kind,
            peer=t.peer,
            chunks=t.chunks,
            nbytes=t.nbytes,
            tokens=t.tokens,
            failed=t.failed,
            seconds=t.seconds,
        )
        for t in kept
    ]
    return TransfersResponse(transfers=rows, recorded=recorded, capacity=recorder.capacity)


@_ui.get("/ui", response_class=HTMLResponse, include_in_schema=False)
async def ui() -> Response:
    """The status page: static, so open to anyone; its data needs the admin token."""
    return page_response()


@_api.get("/nodes", name="nodes")
def nodes(daemon: Daemon, _: Caller) -> NodesResponse:
    """The cluster's live nodes and their hardware classes (what a gateway plans with)."""
    if daemon.cluster is None:
        own = NodeBody(node_id=daemon.node_id, hardware_class=daemon.config.cluster.hardware_class)
        return NodesResponse(nodes=[own], cluster=False)
    classes = daemon.cluster.hardware_classes()  # may ask Redis: a plain def, off the loop
    rows = [NodeBody(node_id=n, hardware_class=c) for n, c in sorted(classes.items())]
    return NodesResponse(nodes=rows, cluster=True)


@_api.post("/admin/evict", name="evict")
def admin_evict(body: EvictRequest, daemon: Daemon, _: Admin) -> EvictResponse:
    return EvictResponse(evicted=daemon.store.evict(body.tier, body.nbytes))


@_api.post(
    "/admin/flush",
    name="flush",
    responses={504: {"model": ErrorResponse, "description": "SSD writes still pending"}},
)
def admin_flush(daemon: Daemon, _: Admin) -> FlushResponse:
    daemon.store.flush()
    return FlushResponse(flushed=True)


def create_app(
    daemon: DaemonView, *, max_body_bytes: int = MAX_BODY_BYTES, parse_workers: int = 0
) -> FastAPI:
    """The HTTP API of ``daemon`` (see the module docstring). ``parse_workers``: processes
    that parse large lookup bodies (0: threads of this process); whoever serves the app ends
    them with ``app.state.lookup_parsers.close()``."""
    app = FastAPI(
        title="kvfabric",
        version=__version__,
        description="KV-hit lookups, stats, admin and Prometheus metrics of one kvfabric node.",
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.daemon = daemon
    app.state.lookup_parsers = LookupParsers(
        parse_workers,
        max_tokens=daemon.config.limits.lookup_max_tokens,
        max_hashes=MAX_KEYS,
        hash_chars=2 * KEY_BYTES,
    )
    for router in (_probes, _scrape, _api, _ui):
        app.include_router(router)
    app.add_exception_handler(KVFabricError, _on_kvfabric_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(BodyInvalid, _on_validation_error)
    app.add_exception_handler(BodyTooLarge, _on_too_large)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the lookup body, which the route reads raw (see lookup)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        body = LookupRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(body.pop("$defs", {}))
        components["LookupRequest"] = body
        schema["paths"]["/v1/lookup"]["post"]["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/LookupRequest"}}
            },
        }
        app.openapi_schema = schema
    return app.openapi_schema
