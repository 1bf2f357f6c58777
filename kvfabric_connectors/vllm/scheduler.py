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
* hybrid attention (several layer sets, :mod:`.groups`): the load stops where every
  sliding-window set holds the window before it, into live blocks only, and is always
  asynchronous with several KV cache groups (vLLM takes their failures per request);
  sliding-window sets save only chunks whose blocks are all live (vLLM's own block
  tables, read through ``bind_blocks``);
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvfabric.client import Client
from kvfabric.errors import KVFabricError, UnavailableError, UnsupportedError
from kvfabric.hashing import ChunkRef, as_token_array, chunk_hashes
from kvfabric.lookup import LookupResult
from kvfabric.spec import Namespace
from kvfabric_connectors.link import DaemonLink

from .events import EventRelay
from .groups import LayerPlan, all_live, live_start, usable_stop
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
    block_ids: list[int] = field(default_factory=list)  # KV cache group 0's
    groups: list[list[int]] = field(default_factory=list)  # every group's (a layer plan)
    set_refs: list[list[ChunkRef]] = field(default_factory=list)  # per layer set; [0]: refs
    window_held: list[list[bool]] = field(default_factory=list)  # per set: chunks it holds
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
        self.plan: LayerPlan | None = namespaces.plan
        # vLLM's block tables per group (null entries where blocks were freed): bind_blocks
        self._resolve: Callable[[str], Sequence[Sequence[int]]] | None = None
        self._null_block = 0

    def bind_blocks(self, resolve: Callable[[str], Sequence[Sequence[int]]], null: int) -> None:
        """vLLM's own view of a request's blocks (``KVCacheManager.get_block_ids``) and its
        null block id: the scheduler's output lists new blocks, never the ones a sliding
        window freed, so sliding-window saves ask the manager instead."""
        self._resolve, self._null_block = resolve, null

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
        if self.plan is not None:  # nothing known of a window set: it holds nothing
            chunk = self.namespaces.spec.chunk_tokens
            usable = usable_stop(usable, num_computed_tokens, chunk, self.plan, state.window_held)
        tokens = max(0, usable - num_computed_tokens)
        return tokens, (state.remote or self._async_loads) and tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        state.load = (state.local_tokens, state.local_tokens + num_external_tokens)
        if state.remote or self._async_loads:  # not scheduled until loaded: plan it now
            self._set_blocks(state, blocks.get_block_ids())

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        loads: list[RequestTransfer] = []
        saves: list[RequestTransfer] = []
        for pending in self._requests.values():
            if pending.load is not None and (pending.remote or self._async_loads):
                loads.extend(self._loads(pending, *pending.load, background=True))
                pending.load, pending.loading = None, True
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                self._set_blocks(state, new.block_ids)
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
                self._set_blocks(state, new_blocks)  # a resumed request lists all of them
            elif new_blocks is not None:
                for group, more in zip(state.groups, new_blocks):
                    group.extend(more)
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
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.loading = False
                if req_id in failed:  # several groups: vLLM takes failures per request
                    state.forget_hit()

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
        set_refs = [chunk_hashes(ns, prompt)]
        set_refs += [
            chunk_hashes(self.namespaces.get(salt, lora, s), prompt)
            for s in range(1, self.namespaces.num_sets)
        ]
        state = _Request(
            request.request_id,
            salt,
            lora,
            set_refs[0],
            len(prompt),
            handoff,
            expect_tokens=handoff.expect_tokens,
            prompt_ids=prompt.tobytes() if self.saves else b"",
            set_refs=set_refs,
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
            if self.plan is not None:
                state.window_held = self._window_held(client, state)
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

    def _window_held(self, client: Client, state: _Request) -> list[list[bool]]:
        """Per layer set, the chunks of the prompt this node holds ([] for full attention:
        its prefix is the lookup's). Sliding-window sets hold what was live when each chunk
        was computed, not a prefix: asked chunk by chunk (``contains``, this node only)."""
        assert self.plan is not None
        held: list[list[bool]] = []
        for s, layer_set in enumerate(self.plan.sets):
            if layer_set.window is None:
                held.append([])
                continue
            ns = self.namespaces.get(state.tenant_salt, state.lora_id, s)
            held.append(list(client.contains(ns, [ref.key for ref in state.set_refs[s]])))
        return held

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
            loads.extend(self._loads(state, *state.load))
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
        if chunks and self.plan is None:
            saves.append(self._transfer(state, chunks))
        elif chunks:
            saves.extend(self._window_saves(state, chunks))

    def _window_saves(self, state: _Request, chunks: list[ChunkSlice]) -> list[RequestTransfer]:
        """One transfer per layer set: every chunk for full attention, the chunks whose
        blocks are all live in vLLM's tables for a sliding window (none without them)."""
        assert self.plan is not None
        plan, groups = self.plan, self._live_groups(state)
        out = []
        for s, layer_set in enumerate(plan.sets):
            mine = []
            for c in chunks:
                end = c.start + c.num_tokens
                if layer_set.window is not None and (
                    groups is None or not all_live(plan, s, groups, self._null_block, c.start, end)
                ):
                    continue  # slid out of the window: its blocks are freed, maybe reused
                ref = state.set_refs[s][c.start // self.namespaces.spec.chunk_tokens]
                mine.append(replace(c, key=ref.key, parent=ref.parent))
            if mine:
                out.append(self._transfer(state, mine, layer_set=s, groups=groups))
        return out

    def _loads(
        self, state: _Request, first: int, last: int, *, background: bool = False
    ) -> list[RequestTransfer]:
        """Request tokens ``[first, last)`` per layer set; a sliding-window set's from its
        first live block on (vLLM freed the ones before: nothing to write there)."""
        if self.plan is None:
            return [self._transfer(state, self._slices(state, first, last), background=background)]
        out = []
        for s, layer_set in enumerate(self.plan.sets):
            start = first
            if layer_set.window is not None:
                start = max(first, live_start(self.plan, s, state.groups, self._null_block))
            if start < last:
                slices = self._slices(state, start, last, s)
                out.append(self._transfer(state, slices, background=background, layer_set=s))
        return out

    def _slices(
        self, state: _Request, first: int, last: int, layer_set: int = 0
    ) -> list[ChunkSlice]:
        """The chunk slices covering request tokens ``[first, last)``."""
        size = self.namespaces.spec.chunk_tokens
        out = []
        for index in range(first // size, (last - 1) // size + 1):
            ref = state.set_refs[layer_set][index]
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
        self,
        state: _Request,
        chunks: list[ChunkSlice],
        *,
        background: bool = False,
        layer_set: int = 0,
        groups: Sequence[Sequence[int]] | None = None,
    ) -> RequestTransfer:
        tables = state.groups if groups is None else groups
        return RequestTransfer(
            state.req_id,
            state.tenant_salt,
            state.lora_id,
            tuple(tables[0]) if self.plan is not None else tuple(state.block_ids),
            tuple(chunks),
            state.handoff.push_to,
            background,
            layer_set,
            tuple(tuple(g) for g in tables) if self.plan is not None else (),
        )

    def _set_blocks(self, state: _Request, tables: Sequence[Sequence[int]]) -> None:
        state.groups = [list(g) for g in tables]
        state.block_ids = state.groups[0] if state.groups else []

    def _live_groups(self, state: _Request) -> Sequence[Sequence[int]] | None:
        """vLLM's block tables of the request now (freed blocks null); None unbound."""
        return None if self._resolve is None else self._resolve(state.req_id)

    @property
    def _async_loads(self) -> bool:
        return self.plan is not None and self.plan.async_loads
