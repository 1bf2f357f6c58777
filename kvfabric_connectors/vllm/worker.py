"""Worker side of the connector: moves KV between vLLM's paged cache and the node daemon.

Runs in each model worker. Per step, with the metadata the scheduler side built:

* ``start_load`` pins the chunks to load and starts a thread that copies them into the
  request's blocks one layer at a time; ``wait_for_layer`` lets attention of layer i run as
  soon as layer i is in place (a chunk still arriving by push is read layer by layer as its
  layers land). A background load (chunks only another node holds) first has the daemon
  pull them, on a connection of its own, and is reported done by ``take_load_results``
  while the engine runs other requests;
* ``save_layer`` copies layer i of every chunk completed this step into shared memory
  reserved on the daemon and commits that layer for all of them in one round trip, so
  readers (and a push to another node) can start on it while later layers compute;
* ``finish_step`` joins the loads and completes the saves; failures never reach the
  engine: the blocks of a failed load are reported (vLLM recomputes them) and a failed save
  is dropped (a future miss). The saves' round trips run inside the forward pass, so they
  have a deadline of their own (``rpc_timeout_s``): a frozen daemon costs one step that
  much, then the connector stops saving for a while (``DaemonLink``'s back-off) and counts
  what it skipped (``save_skipped_chunks``) instead of waiting.

Conversion between the engine's block layout and kvfabric's canonical one happens here, at
the edge (:mod:`.layout`; MLA's latent cache: :mod:`.mla_layout`).

Hybrid attention (vLLM's hybrid KV cache manager, :mod:`.groups`): each engine layer has a
place, its layer set (namespace), its layer in that set's objects and its KV cache group,
whose block table indexes its cache; a transfer moves one set's objects. With several
groups a failed load is reported per request (:meth:`WorkerSide.take_load_results`), since
vLLM cannot map block ids of several groups back to requests.

Tensor parallelism: the canonical object holds every KV head of the model, so engines with
different tensor parallelism share it. Each rank's cache holds a share of it
(:func:`.namespace.rank_share`, from vLLM's tensor-parallel rank and size): with TP
dividing the KV heads H, rank r holds heads ``[r*H/TP, (r+1)*H/TP)``; with TP a multiple
of H (each head replicated on TP/H ranks), rank r holds head ``r // (TP/H)``; MLA's latent
(and a single KV head) is replicated on every rank. A rank saves only its range, with its
own writer of the shared object (``reserve_many(..., heads=)``); of replicas only the
first saves; rank 0 alone pushes. A layer of the object becomes readable once every range
of it landed, so a rank loading its range never sees another rank's half-written heads,
and the daemon counts the object as a hit only once it is complete. Every rank loads its
own range, whatever the producer's parallelism was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.client import RemoteReader, RemoteWriter
from kvfabric.convert.dtype import layer_in_place, read_layer, write_layer
from kvfabric.errors import AlreadyExistsError, KVFabricError
from kvfabric.hashing import ChunkRef
from kvfabric.spec import AttentionKind
from kvfabric_connectors.link import DaemonLink

from .groups import Placement
from .layout import PagedLayout, layout_for_vllm_cache
from .metadata import ChunkSlice, KVFabricMetadata, RequestTransfer
from .mla_layout import mla_layout_for_vllm_cache
from .namespace import Namespaces, RankShare, rank_share
from .settings import ConnectorSettings
from .stats import TransferCounters

log = logging.getLogger(__name__)


@dataclass
class _Item:
    """One chunk of one request in flight this step."""

    transfer: RequestTransfer
    chunk: ChunkSlice
    blocks: tuple[torch.Tensor, ...]  # per KV cache group
    handle: RemoteReader | RemoteWriter | None = None


class WorkerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        namespaces: Namespaces,
        block_size: int,
        engine_dtype: torch.dtype,
        share: RankShare | None = None,
        *,
        moves: bool = True,
    ) -> None:
        """``share``: this rank's part of the canonical object; None asks vLLM for this
        process's tensor-parallel rank. ``moves``: False for a model whose KV the connector
        cannot move (:mod:`.groups`: recurrent state); it then only stays out of the way."""
        self.moves = moves
        self.settings = settings
        self.namespaces = namespaces
        self.block_size = block_size  # the scheduler's: block_ids index tokens by it
        spec = namespaces.spec
        self.share = share if share is not None else rank_share(spec, *_tensor_parallel_rank())
        self._engine_dtype = engine_dtype  # as the engine's cache holds it
        self.link = DaemonLink(
            settings.socket_path, settings.token, timeout=settings.load_timeout_s, engine="vllm"
        )
        # the forward pass waits for the saves' round trips: a short deadline of their own
        self._save_link = DaemonLink(
            settings.socket_path,
            settings.token,
            timeout=settings.rpc_timeout_s,
            engine="vllm",
        )
        # a push holds its connection until the target has every layer: its own link
        self._push_link = DaemonLink(
            settings.socket_path, settings.token, timeout=settings.save_timeout_s, engine="vllm"
        )
        self._pushes = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-push")
        # a pull holds its connection until the chunks are here: background loads get theirs
        self._background_link = DaemonLink(
            settings.socket_path, settings.token, timeout=settings.load_timeout_s, engine="vllm"
        )
        self._lock = threading.Lock()  # background loads report from their threads
        self._background: list[_LayerLoad] = []
        self._finished_loads: set[str] = set()
        self.counters = TransferCounters()
        self._caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}  # engine layer order (the loads' events)
        self._place: dict[str, Placement] = {}
        self._failed_requests: set[str] = set()  # several groups: failed loads, per request
        self._layout: PagedLayout | None = None
        self._load: _LayerLoad | None = None
        self._saving: list[_Item] | None = None
        self._failed_blocks: set[int] = set()

    # -- setup -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        if not self.moves:
            return
        names = sorted(kv_caches, key=extract_layer_index)
        plan = self.namespaces.plan
        if plan is not None:  # several groups share tensors; only attention layers move
            names = [name for name in names if name in plan.place]
        expected = self.namespaces.spec.num_layers if plan is None else len(plan.place)
        if len(names) != expected:
            raise ValueError(f"the engine has {len(names)} KV cache layers, the spec {expected}")
        self._caches = {name: kv_caches[name] for name in names}
        self._layer_of = {name: i for i, name in enumerate(names)}
        self._place = {
            name: Placement(0, i, 0) if plan is None else plan.place[name]
            for i, name in enumerate(names)
        }
        first = kv_caches[names[0]]
        spec = self.namespaces.spec
        cpu = first.device.type == "cpu"
        if cpu and torch.cpu._is_amx_tile_supported():
            # Linux grants AMX per process on first request; asked for while the load
            # thread exists, the engine's first AMX attention kernel died with SIGILL
            torch.cpu._init_amx()
        if spec.kind is AttentionKind.MLA:  # one latent row per token, on any device
            self._layout = mla_layout_for_vllm_cache(
                first, block_size=self.block_size, latent_dim=spec.head_dim
            )
        else:
            self._layout = layout_for_vllm_cache(
                first,
                block_size=self.block_size,
                num_kv_heads=self.share.num_heads(spec),
                head_dim=spec.head_dim,
                device_type=first.device.type,
                isa=_cpu_isa(self._engine_dtype, self.block_size, spec.head_dim) if cpu else None,
            )

    # -- loads -------------------------------------------------------------------------

    def start_load(self, meta: KVFabricMetadata) -> None:
        if not meta.loads:
            return
        assert self._layout is not None, "register_kv_caches first"
        now = [_Item(t, c, _blocks(t)) for t in meta.loads if not t.background for c in t.chunks]
        if now:
            self._load = _LayerLoad(self, now, self.link)
            self._load.start()
        # one load per request, its layer sets together: vLLM takes a request's end once
        per_request: dict[str, list[_Item]] = {}
        for transfer in (t for t in meta.loads if t.background):
            blocks = _blocks(transfer)
            items = per_request.setdefault(transfer.req_id, [])
            items.extend(_Item(transfer, c, blocks) for c in transfer.chunks)
        for items in per_request.values():
            load = _LayerLoad(self, items, self._background_link, on_done=self._background_done)
            with self._lock:
                self._background.append(load)
            load.start()

    def wait_for_layer(self, layer_name: str) -> None:
        if self._load is not None:
            self._load.wait(self._layer_of[layer_name])

    def take_load_results(self) -> tuple[set[str], set[str]]:
        """Requests whose background load ended, and those of them whose load failed
        (several KV cache groups; one group reports blocks: :meth:`take_failed_blocks`),
        taken together so a failure is never reported before its end."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            failed, self._failed_requests = (
                self._failed_requests & done,
                self._failed_requests - done,
            )
        return done, failed

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _record_failures(self, load: _LayerLoad) -> None:
        plan = self.namespaces.plan
        if plan is not None and plan.async_loads:
            with self._lock:
                self._failed_requests |= load.failed
            return
        blocks = {
            b
            for item in load.items
            if item.transfer.req_id in load.failed
            for b in _loaded_blocks(item, self.block_size)
        }
        with self._lock:
            self._failed_blocks |= blocks

    def _background_done(self, load: _LayerLoad) -> None:
        self._record_failures(load)
        self.counters.add(background_loads=1)
        with self._lock:
            self._finished_loads.update(item.transfer.req_id for item in load.items)
            self._background.remove(load)

    # -- saves -------------------------------------------------------------------------

    def save_layer(self, meta: KVFabricMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not meta.saves or not self.share.saves:
            return
        started = time.perf_counter()
        try:
            self._save_layer(meta, layer_name, kv_layer)
        finally:
            # the forward pass waits for this: the connector's whole cost to a saving step
            self.counters.add(save_seconds=time.perf_counter() - started)

    def _save_layer(self, meta: KVFabricMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        if self._saving is None:
            self._saving = self._reserve(meta.saves)
        place = self._place[layer_name]
        layer = place.object_layer
        live = [
            item
            for item in self._saving
            if item.handle is not None and item.transfer.layer_set == place.layer_set
        ]
        if not live:
            return
        assert self._layout is not None
        try:
            for item in live:
                chunk = item.chunk
                # straight into the fabric's pages where they take the engine's dtype as is
                target = layer_in_place(item.handle, layer, self._layout.dtype)  # type: ignore[arg-type]
                canonical = self._layout.gather(
                    kv_layer, item.blocks[place.group], chunk.start, chunk.num_tokens, out=target
                )
                if target is None:  # converted, or quantized for fp8, on the way
                    write_layer(item.handle, layer, canonical)  # type: ignore[arg-type]
            self._save_link.client().commit_layer_many([i.handle for i in live], layer)  # type: ignore[misc]
        except (KVFabricError, OSError, ValueError) as exc:
            self._abandon_saves(exc)

    def finish_step(self) -> None:
        """End of a step: loads are in place (or reported failed), saves complete."""
        if self._load is not None:
            self._load.join()
            self._load = None
        saving, self._saving = self._saving, None
        if not saving:
            return
        writers = [i.handle for i in saving if i.handle is not None and not i.handle.closed]
        try:
            if writers:  # layers save_kv_layer did not see (none, normally)
                self._save_link.client().commit_many(writers)  # type: ignore[arg-type]
        except (KVFabricError, OSError) as exc:
            self._saving = saving
            self._abandon_saves(exc)
            self._saving = None
            return
        stored = [i for i in saving if i.handle is not None]
        self.counters.add(
            saved_chunks=len(stored), saved_tokens=sum(i.chunk.num_tokens for i in stored)
        )

    def _reserve(self, transfers: tuple[RequestTransfer, ...]) -> list[_Item]:
        items: list[_Item] = []
        if self._save_link.down:  # it said so once; the step goes on without saving
            self.counters.add(save_skipped_chunks=sum(len(t.chunks) for t in transfers))
            return items
        for transfer in transfers:
            ns = self.namespaces.get(transfer.tenant_salt, transfer.lora_id, transfer.layer_set)
            refs = [ChunkRef(c.key, c.parent, c.num_tokens) for c in transfer.chunks]
            try:
                results = self._save_link.client().reserve_many(
                    ns,
                    refs,
                    heads=self.share.heads,
                    tokens=[c.tokens or None for c in transfer.chunks],  # b"": none given
                )
            except (KVFabricError, OSError) as exc:
                self._save_link.failed(exc)
                self.counters.add(save_errors=len(refs))
                log.warning(
                    "kvfabric: cannot save %d chunks of %s: %s", len(refs), transfer.req_id, exc
                )
                continue
            blocks = _blocks(transfer)
            for chunk, result in zip(transfer.chunks, results):
                if isinstance(result, RemoteWriter):
                    items.append(_Item(transfer, chunk, blocks, result))
                elif not isinstance(result, AlreadyExistsError):
                    self.counters.add(save_errors=1)
                    log.warning("kvfabric: cannot save a chunk of %s: %s", transfer.req_id, result)
        if self.share.pushes:
            for (tenant_salt, lora_id, target, layer_set), keys in _push_groups(transfers).items():
                self._pushes.submit(self._push, tenant_salt, lora_id, target, keys, layer_set)
        return items

    def _abandon_saves(self, exc: BaseException) -> None:
        self._save_link.failed(exc)
        saving, self._saving = self._saving or [], []
        log.warning("kvfabric: dropping this step's saves (%d chunks): %s", len(saving), exc)
        self.counters.add(save_errors=len(saving))
        for item in saving:
            if item.handle is not None:
                try:
                    item.handle.abort()  # type: ignore[union-attr]
                except (KVFabricError, OSError):
                    pass  # the daemon reclaims the lease by its deadline anyway
                item.handle = None

    def _push(
        self, tenant_salt: str, lora_id: str, target: str, keys: list[bytes], layer_set: int
    ) -> None:
        ns = self.namespaces.get(tenant_salt, lora_id, layer_set)
        try:
            result = self._push_link.client().push(
                ns, keys, target, timeout=self.settings.save_timeout_s
            )
        except (KVFabricError, OSError) as exc:
            self._push_link.failed(exc)
            self.counters.add(push_errors=len(keys))
            log.warning("kvfabric: push of %d chunks to %s failed: %s", len(keys), target, exc)
            return
        self.counters.add(
            pushed_chunks=int(result.get("pushed", 0)) + int(result.get("already_there", 0)),
            push_errors=int(result.get("failed", 0)),
        )

    def close(self) -> None:
        if self._load is not None:
            self._load.join()
        with self._lock:
            background = list(self._background)
        for load in background:
            load.thread.join()
        self._pushes.shutdown(wait=True)
        for link in (self.link, self._save_link, self._push_link, self._background_link):
            link.close()


class _LayerLoad:
    """One step's loads, copied into the engine's blocks layer by layer on a thread."""

    def __init__(
        self,
        worker: WorkerSide,
        items: list[_Item],
        link: DaemonLink,
        *,
        on_done: Callable[[_LayerLoad], None] | None = None,
    ) -> None:
        self.worker = worker
        self.items = items
        self.link = link
        self.on_done = on_done
        self.layers = list(worker._caches.items())
        self.events = [threading.Event() for _ in self.layers]
        self.failed: set[str] = set()  # request ids
        self.deadline = time.monotonic() + worker.settings.load_timeout_s
        self.thread = threading.Thread(target=self._run, name="kvfabric-load", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wait(self, layer: int) -> None:
        self.events[layer].wait(max(0.0, self.deadline - time.monotonic()) + 1.0)

    def join(self) -> None:
        self.thread.join()
        self.worker._record_failures(self)

    def _run(self) -> None:
        try:
            self._load()
        except Exception:
            log.exception("kvfabric: load failed unexpectedly, recomputing")
            self.failed.update(item.transfer.req_id for item in self.items)
        finally:
            if self.on_done is not None:
                self.on_done(self)  # else vLLM would wait for this request forever

    def _load(self) -> None:
        worker = self.worker
        started = time.perf_counter()
        try:
            self._pin()
            layout = worker._layout
            assert layout is not None
            for index, (name, cache) in enumerate(self.layers):
                place = worker._place[name]
                for item in self.items:
                    if (
                        item.transfer.layer_set == place.layer_set
                        and item.transfer.req_id not in self.failed
                    ):
                        self._copy(layout, cache, place, item)
                self.events[index].set()
        except (KVFabricError, OSError) as exc:
            self.link.failed(exc)
            log.warning("kvfabric: load failed, recomputing: %s", exc)
            self.failed.update(item.transfer.req_id for item in self.items)
        finally:
            for event in self.events:
                event.set()
            self._release()
        loaded = [i for i in self.items if i.transfer.req_id not in self.failed]
        worker.counters.add(
            loaded_chunks=len(loaded),
            loaded_tokens=sum(i.chunk.stop - i.chunk.begin for i in loaded),
            load_errors=len(self.items) - len(loaded),
            load_seconds=time.perf_counter() - started,
        )

    def _pin(self) -> None:
        """Pin every chunk; pull the ones this node lacks first. A background load (the
        scheduler's lookup found chunks only other nodes hold) pulls before it pins, so the
        pulled chunks are never asked for while absent (each would be a not_found get in the
        daemon's metrics); a load of local chunks pulls only what went missing since."""
        client = self.link.client()
        by_request: dict[tuple[str, int], list[_Item]] = {}  # one per request and layer set
        for item in self.items:
            key = (item.transfer.req_id, item.transfer.layer_set)
            by_request.setdefault(key, []).append(item)
        for req_items in by_request.values():
            transfer = req_items[0].transfer
            ns = self.worker.namespaces.get(
                transfer.tenant_salt, transfer.lora_id, transfer.layer_set
            )
            keys = [i.chunk.key for i in req_items]
            if transfer.background:  # the daemon skips the chunks it holds already
                self._pull(client, ns, keys, transfer.req_id)
            readers = client.get_many(ns, keys, timeout=self._left())
            missing = [k for k, r in zip(keys, readers) if r is None]
            if (
                missing
                and not transfer.background
                and self._pull(client, ns, missing, transfer.req_id)
            ):
                again = iter(client.get_many(ns, missing, timeout=self._left()))
                readers = [r if r is not None else next(again) for r in readers]
            for item, reader in zip(req_items, readers):
                item.handle = reader
            if any(r is None for r in readers):
                log.warning(
                    "kvfabric: %s lost %d chunks before they could be loaded",
                    transfer.req_id,
                    sum(r is None for r in readers),
                )
                self.failed.add(transfer.req_id)

    def _pull(self, client: Any, ns: Any, keys: list[bytes], req_id: str) -> bool:
        """Have the daemon pull chunks only other nodes hold; False if it cannot."""
        try:
            client.prefetch(ns, keys=keys, timeout=self._left())
        except (KVFabricError, OSError) as exc:  # a lost daemon shows on the next call
            log.warning(
                "kvfabric: %s: %d chunks are not on this node and cannot be pulled (%s)",
                req_id,
                len(keys),
                exc,
            )
            return False
        return True

    def _copy(
        self, layout: PagedLayout, cache: torch.Tensor, place: Placement, item: _Item
    ) -> None:
        layer = place.object_layer
        reader = item.handle
        assert isinstance(reader, RemoteReader)
        try:
            reader.wait_layer(layer, timeout=self._left())
            # [2, this rank's heads, tokens, head_dim] in the engine's dtype: a view of
            # the shared pages when nothing needs converting (all heads, same dtype)
            canonical = read_layer(
                reader, layer, heads=self.worker.share.heads, dtype=self.worker._engine_dtype
            )
            chunk = item.chunk
            layout.scatter(
                cache,
                item.blocks[place.group],
                chunk.start + chunk.begin,
                canonical[:, :, chunk.begin : chunk.stop],
            )
        except (KVFabricError, OSError, ValueError) as exc:
            log.warning(
                "kvfabric: loading %s failed, recomputing it: %s", item.transfer.req_id, exc
            )
            self.failed.add(item.transfer.req_id)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise KVFabricError("kvfabric load deadline passed")
        return left

    def _release(self) -> None:
        readers = [i.handle for i in self.items if isinstance(i.handle, RemoteReader)]
        try:
            self.link.client().release_many(readers)
        except (KVFabricError, OSError):
            pass  # the pins expire with their leases


def _blocks(transfer: RequestTransfer) -> tuple[torch.Tensor, ...]:
    """The transfer's block table per KV cache group."""
    return tuple(
        torch.tensor(transfer.group_blocks(g), dtype=torch.int64)
        for g in range(max(1, len(transfer.groups)))
    )


def _loaded_blocks(item: _Item, block_size: int) -> set[int]:
    """The blocks holding the tokens a chunk slice loads."""
    first = item.chunk.start + item.chunk.begin
    last = item.chunk.start + item.chunk.stop - 1
    return set(item.transfer.block_ids[first // block_size : last // block_size + 1])


def _tensor_parallel_rank() -> tuple[int, int]:
    """This worker's tensor-parallel rank and world size."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    return str(_get_attn_isa(dtype, block_size, head_dim))


def _push_groups(
    transfers: tuple[RequestTransfer, ...],
) -> dict[tuple[str, str, str, int], list[bytes]]:
    """The step's chunks to push, one push per (tenant, LoRA, target, layer set): the
    requests of a step compute their layers together, so one push moves each layer of all
    of them as it is committed; a push per request would wait for the one before it (one
    push thread). Layer sets are namespaces of their own: a push each."""
    groups: dict[tuple[str, str, str, int], list[bytes]] = {}
    for transfer in transfers:
        if transfer.push_to:
            group = groups.setdefault(
                (transfer.tenant_salt, transfer.lora_id, transfer.push_to, transfer.layer_set),
                [],
            )
            group.extend(c.key for c in transfer.chunks)
    return groups
