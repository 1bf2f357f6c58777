"""What the fabric holds of a prompt, per node: one cluster lookup per request.

The gateway hashes the prompt's full chunks with kvfabric's own hashing
(:func:`kvfabric.hashing.chunk_keys`, in the namespace the engines' connectors use: the
model id, the KV spec, the request's ``cache_salt`` as tenant salt) and asks one daemon's
HTTP API (``POST /v1/lookup``, ``scope: cluster``) which live nodes hold how long a prefix of
that chain; the answer becomes :class:`kvfabric.sched.model.Holdings` (tokens per node).

A fabric that cannot answer (daemon down, slow past ``timeout_s``, no global index) never
fails a request: the lookup returns empty holdings with ``ok=False`` and the gateway routes
on load alone (counted in ``kvfabric_gateway_lookups_total{outcome}``). A daemon without a
global index (embedded, one node) answers ``scope: local`` for itself. The same daemon's
``GET /v1/nodes`` names each live node's hardware class, for engines whose class the
gateway's config leaves to the registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from kvfabric.gateway.upstream import TimedOut, Unreachable, Upstream
from kvfabric.hashing import chunk_keys
from kvfabric.sched.model import Holdings
from kvfabric.spec import KVSpec, Namespace


@dataclass(frozen=True)
class Lookup:
    holdings: Holdings
    ok: bool  # False: the fabric did not answer (holdings are empty)


class _NodeChunks(BaseModel):
    node_id: str
    chunks: int


class _NodeClass(BaseModel):
    node_id: str
    hardware_class: str


class _Answer(BaseModel):
    """The fields of the daemon's lookup answer the gateway reads (others ignored)."""

    matched_tokens: int
    nodes: list[_NodeChunks] | None = None
    stale: bool | None = None


class _Health(BaseModel):
    node_id: str


class _Refused(Exception):
    """The daemon answered the lookup with an error status."""


class _Nodes(BaseModel):
    nodes: list[_NodeClass]


class FabricView:
    """Cluster lookups through one daemon's HTTP API; owned by the gateway's event loop."""

    def __init__(
        self,
        http: Upstream,
        url: str,
        model_id: str,
        spec: KVSpec,
        token: str | None,
        timeout_s: float,
    ) -> None:
        self._http = http
        self._url = url.rstrip("/") + "/v1/lookup"
        self._health = url.rstrip("/") + "/healthz"
        self._nodes = url.rstrip("/") + "/v1/nodes"
        self._model_id = model_id
        self._spec = spec
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout_s
        self._local_node: str | None = None  # the daemon's own id, for local-only lookups

    def namespace(self, cache_salt: str = "", lora: str = "") -> Namespace:
        return Namespace(self._model_id, self._spec, cache_salt, lora)

    def keys(self, tokens: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """The chain of the prompt's full chunks (the only ones a prefix lookup matches)."""
        return chunk_keys(self.namespace(cache_salt), tokens, include_partial=False)

    async def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> Lookup:
        keys = self.keys(tokens, cache_salt)
        if not keys:
            return Lookup(Holdings(), True)
        body: dict[str, object] = {
            "namespace": {
                "model": self._model_id,
                "spec": self._spec.to_dict(),
                "tenant": cache_salt,
                "lora": "",
            },
            "chunk_hashes": [k.hex() for k in keys],
            "scope": "cluster",
        }
        try:
            answer = await self._post(body)
            if answer is None:  # no global index: what this daemon holds itself
                body["scope"] = "local"
                local = await self._post(body)
                node = await self._node_id()
                if local is None or node is None:
                    return Lookup(Holdings(), False)
                return Lookup(Holdings({node: local.matched_tokens}), True)
        except (Unreachable, TimedOut, _Refused, ValidationError):
            return Lookup(Holdings(), False)
        step = self._spec.chunk_tokens
        by_node = {n.node_id: n.chunks * step for n in answer.nodes or () if n.chunks > 0}
        return Lookup(Holdings(by_node), not answer.stale)

    async def node_classes(self) -> dict[str, str] | None:
        """The registry's live nodes and their hardware classes (``GET /v1/nodes``); None
        when the fabric does not answer."""
        try:
            answer = await self._http.get(self._nodes, self._timeout, self._headers)
            if answer.status != 200:
                return None
            found = _Nodes.model_validate_json(answer.body)
        except (Unreachable, TimedOut, ValidationError):
            return None
        return {n.node_id: n.hardware_class for n in found.nodes}

    async def _post(self, body: dict[str, object]) -> _Answer | None:
        """The lookup's answer; None when the daemon has no global index (503)."""
        answer = await self._http.post(self._url, body, self._timeout, self._timeout, self._headers)
        if answer.status == 503 and body["scope"] == "cluster":
            return None
        if answer.status != 200:
            raise _Refused(answer.status)
        return _Answer.model_validate_json(answer.body)

    async def _node_id(self) -> str | None:
        if self._local_node is None:
            answer = await self._http.get(self._health, self._timeout)
            if answer.status != 200:
                return None
            self._local_node = _Health.model_validate_json(answer.body).node_id
        return self._local_node
