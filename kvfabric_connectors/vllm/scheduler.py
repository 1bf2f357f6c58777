"""Scheduler side of the connector: what to load and what to save, per request and step.

Runs in vLLM's scheduler (the EngineCore process in the default two-process engine). It
hashes each prompt once into kvfabric chunks (namespace-seeded, independent of the engine's
block size), asks the local daemon how long a prefix the fabric holds, and turns the
scheduler's decisions into :class:`~.metadata.KVFabricMetadata` for the workers:

* loads: the tokens past vLLM's own prefix hit that the fabric holds, capped one short of
  the prompt so the engine computes at least one token. Chunks this node holds load within
  the step, layer by layer; a hit that needs chunks from another node loads in the
  background (vLLM's asynchronous load: the request waits, other requests run) while the
  daemon pulls them;
* saves: every chunk of the prompt once all its tokens are computed (chunked prefill spreads
  them over steps), the partial last chunk included, except chunks the fabric already had.

A producer (saves on) announces in ``kv_transfer_params`` (``{"kvfabric": {"tokens": n}}``,
plus vLLM's P/D keys when the request asked in that dialect: :mod:`.handoff`) the prompt
tokens its node's fabric holds when the request finishes: one ``contains`` of the
prompt's chunks on this side's link, when the step's saves are committed (a check, not a
lookup: the daemon's hit-rate metrics do not see it). A producer whose saves went nowhere
(the daemon is down, or refuses the engine's token: the worker's link fails the same way,
since it has the same socket and token) or that holds none of the prompt returns no params,
so no consumer waits for KV that was never stored.

A consumer whose request carries such params waits, up to ``expect_timeout_s``, until the
fabric holds those tokens: the producer's push may still be landing. Lookups carry the
prompt's length, so the daemon counts a missed partial last chunk by its real tokens. Not
thread-safe (vLLM calls it from the scheduler loop only).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvfabric.client import Client
from kvfabric.errors import KVFabricError, UnavailableError, UnsupportedError
from kvfabric.hashing import ChunkRef, as_token_array, chunk_hashes
from kvfabric.lookup import LookupResult
from kvfabric.spec import Namespace
from kvfabric_connectors.link import DaemonLink

from .events import EventRelay
from .handoff import Handoff, answer, read_params
from .metadata import ChunkSlice, KVFabricMetadata, RequestTransfer
from .namespace import Namespaces, lora_id_of
from .settings import ConnectorSettings

log = logging.getLogger(__name__)

# vLLM's hit sources, by the kind of tier that held the tokens
TIER_SOURCES = {"device": "device", "dram": "host", "cxl": "host", "ssd": "disk"}


@dataclass
class _Request:
    req_id: str
    tenant_salt: str
    lora_id: str
    refs: list[ChunkRef]  # the whole prompt, partial last chunk included
    prompt_tokens: int
    handoff: Handoff  # what the request's kv_transfer_params ask
    expect_tokens: int = 0  # announced by a producer (kv_transfer_params)
    lookup: LookupResult | None = None
    hit_tokens: int = 0  # prompt tokens the fabric holds (local or on another node)
    waiting_since: float | None = None
    local_tokens: int = 0  # vLLM's own prefix hit, as last offered to the connector
    load: tuple[int, int] | None = None  # request tokens to load next step
    remote: bool = False  # the hit needs chunks only other nodes hold: load in background
    loading: bool = False  # a background load is in flight (its blocks must stay)
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # first chunk not yet saved or known to be in the fabric
    prompt_ids: bytes = b""  # saves on: the prompt's token ids (int32-LE), each save's own
    load_failed: bool = False  # a load of it failed: offer only what this node holds

    def forget_hit(self) -> None:
        """A load into this request's blocks failed (chunks lost, a daemon or owner down):
        the next offer asks the daemon again, and counts this node's chunks only."""
        self.lookup, self.hit_tokens, self.remote, self.load_failed = None, 0, False, True


class SchedulerSide:
    def __init__(
        self, settings: ConnectorSettings, namespaces: Namespaces, *, loads: bool, saves: bool
    ) -> None:
        self.settings = settings
        self.namespaces = namespaces
        self.loads = loads
        self.saves = saves
        # lookups run while the engine schedules: a short deadline (a frozen daemon is a miss)
        self.link = DaemonLink(
            settings.socket_path, settings.token, timeout=settings.rpc_timeout_s, engine="vllm"
        )
        self._requests: dict[str, _Request] = {}
        self._cluster_scope = True  # until the daemon says it has no global index
        self._intends = True  # until the daemon says it publishes no KV events
        self.events: EventRelay | None = None  # the fabric's blocks in the engine's KV events

    def publish_events(self, block_size: int) -> None:
        """Relay the fabric's blocks of this engine's namespaces into vLLM's KV events
        (:mod:`.events`), starting with the base model's."""
        link = DaemonLink(
            self.settings.socket_path,
            self.settings.token,
            timeout=self.settings.load_timeout_s,
            engine="vllm",
        )
        self.events = EventRelay(link, block_size, self.settings.kv_events_poll_s)
        self.events.watch(self.namespaces.get("", ""))

    # -- hooks -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._track(request)
        state.local_tokens = num_computed_tokens
        if not self.loads:
            return 0, False
        if state.lookup is None or state.hit_tokens < state.expect_tokens:
            self._lookup(state)
        if state.hit_tokens < state.expect_tokens and self._still_expecting(state):
            return None, False  # ask again next step: the producer's KV is on its way
        usable = min(state.hit_tokens, state.prompt_tokens - 1)
        tokens = max(0, usable - num_computed_tokens)
        return tokens, state.remote and tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        state.load = (state.local_tokens, state.local_tokens + num_external_tokens)
        if state.remote:  # not scheduled until loaded: plan it with the blocks it got
            state.block_ids = list(blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        loads: list[RequestTransfer] = []
        saves: list[RequestTransfer] = []
        for pending in self._requests.values():
            if pending.load is not None and pending.remote:
                loads.append(
                    self._transfer(pending, self._slices(pending, *pending.load), background=True)
                )
                pending.load, pending.loading = None, True
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(
                    state,
                    new.num_computed_tokens,
                    scheduler_output.num_scheduled_tokens[new.req_id],
                    loads,
                    saves,
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                state.block_ids = list(new_blocks[0])  # a resumed request lists all of them
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            self._plan(
                state,
                cached.num_computed_tokens[i],
                scheduler_output.num_scheduled_tokens[req_id],
                loads,
                saves,
            )
        return KVFabricMetadata(loads=tuple(loads), saves=tuple(saves))

    def update_connector_output(self, output: Any) -> None:
        # vLLM (recompute policy) reschedules a request whose load failed and asks the
        # connector again: offering the cached hit again failed the same way, thousands of
        # times a minute, until the request timed out
        invalid = output.invalid_block_ids or set()
        if invalid:
            for pending in self._requests.values():
                if not invalid.isdisjoint(pending.block_ids):
                    pending.forget_hit()
        for req_id in output.finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.loading = False

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Saves finish within the step that computed them, so blocks are freed at once
        unless a background load still writes into them (vLLM frees them when the worker
        reports it done); a producer's params tell the consumer what the fabric holds of
        the prompt (None: nothing, or the daemon cannot be asked)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        params = answer(state.handoff, self._stored_tokens(state)) if self.saves else None
        return state.loading, params

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """Split a hit by where the fabric held it (vLLM's CacheHitSource values)."""
        state = self._requests.get(request.request_id)
        if state is None or state.lookup is None or num_external_tokens <= 0:
            return {}
        out: dict[str, int] = {}
        left = num_external_tokens
        for tier, tokens in state.lookup.tier_tokens.items():
            take = min(left, tokens)
            if take:
                source = TIER_SOURCES.get(tier.split(":")[0], "external_unspecified")
                out[source] = out.get(source, 0) + take
                left -= take
        if left:
            out["p2p"] = left  # held by another node, pulled or pushed here
        return out

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.link.close()

    # -- helpers -----------------------------------------------------------------------

    def _track(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        salt = request.cache_salt or ""
        lora = lora_id_of(request)
        # converted once (the compiled packer where built): hashed here, sent with saves
        prompt = as_token_array(request.prompt_token_ids or [])
        handoff = read_params(
            request.kv_transfer_params,
            request.request_id,
            len(prompt),
            push_to=self.settings.push_to,
            push_targets=self.settings.push_targets,
        )
        ns = self.namespaces.get(salt, lora)
        if self.events is not None:
            self.events.watch(ns)
        state = _Request(
            request.request_id,
            salt,
            lora,
            chunk_hashes(ns, prompt),
            len(prompt),
            handoff,
            expect_tokens=handoff.expect_tokens,
            prompt_ids=prompt.tobytes() if self.saves else b"",
        )
        self._requests[request.request_id] = state
        return state

    def _lookup(self, state: _Request) -> None:
        ns = self.namespaces.get(state.tenant_salt, state.lora_id)
        keys = [ref.key for ref in state.refs]
        if not keys:
            return
        try:
            client = self.link.client()
            result = self._ask(client, ns, keys, state.prompt_tokens)
        except (KVFabricError, OSError) as exc:
            self.link.failed(exc)
            if not isinstance(exc, UnavailableError):
                log.warning("kvfabric lookup failed: %s", exc)
            return
        chunks = result.matched_chunks
        if not state.load_failed:  # another node's chunks, pulled in the background
            chunks = max(chunks, result.cluster_chunks or 0)
        state.remote = chunks > result.matched_chunks
        first = state.lookup is None
        state.lookup = result
        state.hit_tokens = sum(ref.num_tokens for ref in state.refs[:chunks])
        state.next_save = max(state.next_save, chunks)
        if first and self.saves and self._intends:
            self._intend(client, ns, state, chunks)

    def _intend(self, client: Client, ns: Namespace, state: _Request, first: int) -> None:
        """Announce the chunks this engine will compute (past the fabric's hit) so routers
        reading the node's KV events hear of them now, not only once the step that computes
        them reserves them: a repeat of the prompt can then follow it here."""
        size = self.namespaces.spec.chunk_tokens
        chunks = [
            (ref, state.prompt_ids[i * size * 4 : (i * size + ref.num_tokens) * 4])
            for i, ref in enumerate(state.refs[first:], start=first)
        ]
        if not chunks:
            return
        try:
            client.intend(ns, chunks)
        except UnsupportedError:
            self._intends = False  # the daemon publishes no events: never ask again
        except (KVFabricError, OSError) as exc:
            self.link.failed(exc)
            if not isinstance(exc, UnavailableError):
                log.warning("kvfabric: announcing %s's chunks failed: %s", state.req_id, exc)

    def _ask(
        self, client: Client, ns: Namespace, keys: list[bytes], num_tokens: int
    ) -> LookupResult:
        if self._cluster_scope:
            try:
                return client.lookup(ns, keys=keys, scope="cluster", num_tokens=num_tokens)
            except UnsupportedError:
                self._cluster_scope = False  # a single node: local lookups say it all
        return client.lookup(ns, keys=keys, num_tokens=num_tokens)

    def _stored_tokens(self, state: _Request) -> int:
        """Prompt tokens the node's fabric holds now, as a prefix of whole chunks; 0 when
        the daemon cannot be asked (see the module docstring)."""
        if not state.refs:
            return 0
        ns = self.namespaces.get(state.tenant_salt, state.lora_id)
        try:
            held = self.link.client().contains(ns, [ref.key for ref in state.refs])
        except (KVFabricError, OSError) as exc:
            self.link.failed(exc)
            if not isinstance(exc, UnavailableError):
                log.warning(
                    "kvfabric: cannot tell what the fabric holds of %s: %s", state.req_id, exc
                )
            return 0
        tokens = 0
        for ref, here in zip(state.refs, held):
            if not here:
                break
            tokens += ref.num_tokens
        return tokens

    def _still_expecting(self, state: _Request) -> bool:
        now = time.monotonic()
        if state.waiting_since is None:
            state.waiting_since = now
        if now - state.waiting_since < self.settings.expect_timeout_s:
            return True
        log.warning(
            "request %s: the fabric holds %d of the %d prompt tokens its producer "
            "announced after %.1f s; computing the rest",
            state.req_id,
            state.hit_tokens,
            state.expect_tokens,
            self.settings.expect_timeout_s,
        )
        state.expect_tokens = 0
        return False

    def _plan(
        self,
        state: _Request,
        computed: int,
        scheduled: int,
        loads: list[RequestTransfer],
        saves: list[RequestTransfer],
    ) -> None:
        if state.load is not None and not state.remote:
            loads.append(self._transfer(state, self._slices(state, *state.load)))
            state.load = None
        if not self.saves:
            return
        done = min(computed + scheduled, state.prompt_tokens)
        chunks = []
        while state.next_save < len(state.refs):
            index = state.next_save
            ref = state.refs[index]
            start = index * self.namespaces.spec.chunk_tokens
            if start + ref.num_tokens > done:
                break
            own = state.prompt_ids[start * 4 : (start + ref.num_tokens) * 4]
            chunks.append(ChunkSlice(ref.key, ref.parent, start, ref.num_tokens, tokens=own))
            state.next_save += 1
        if chunks:
            saves.append(self._transfer(state, chunks))

    def _slices(self, state: _Request, first: int, last: int) -> list[ChunkSlice]:
        """The chunk slices covering request tokens ``[first, last)``."""
        size = self.namespaces.spec.chunk_tokens
        out = []
        for index in range(first // size, (last - 1) // size + 1):
            ref = state.refs[index]
            start = index * size
            out.append(
                ChunkSlice(
                    ref.key,
                    ref.parent,
                    start,
                    ref.num_tokens,
                    begin=max(0, first - start),
                    end=min(ref.num_tokens, last - start),
                )
            )
        return out

    def _transfer(
        self, state: _Request, chunks: list[ChunkSlice], *, background: bool = False
    ) -> RequestTransfer:
        return RequestTransfer(
            state.req_id,
            state.tenant_salt,
            state.lora_id,
            tuple(state.block_ids),
            tuple(chunks),
            state.handoff.push_to,
            background,
        )
