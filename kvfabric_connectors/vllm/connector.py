"""``KVFabricConnector``: kvfabric behind vLLM's ``KVConnectorBase_V1``.

vLLM creates the connector twice, once per role, often in different processes:

==================================  =========  ==============================================
hook                                caller     what kvfabric does
==================================  =========  ==============================================
``get_num_new_matched_tokens``      scheduler  one lookup of the prompt's chunks at the node
                                               daemon (the cluster's, where there is one)
``update_state_after_alloc``        scheduler  remember which tokens to load into the blocks
``build_connector_meta``            scheduler  this step's loads and completed chunks to save
``update_connector_output``         scheduler  background loads that ended
``request_finished``                scheduler  frees blocks unless a background load still
                                               writes them; tells a consumer what to expect
                                               (``kv_transfer_params``); the same for
                                               ``request_finished_all_groups`` (HMA)
``bind_kv_cache_manager``           scheduler  reads vLLM's block tables (freed
                                               sliding-window blocks are null there)
``get_external_cache_hit_sources``  scheduler  the hit split by tier (host, disk, p2p)
``take_events``                     scheduler  the fabric's blocks for the engine's KV events
                                               (``--kv-events-config``): :mod:`.events`
``register_kv_caches``              worker     detect the engine's block layout
``start_load_kv``                   worker     pin (pull if remote) and copy in, per layer
``wait_for_layer_load``             worker     layer i is in place before attention i
``save_kv_layer``                   worker     layer i of completed chunks -> shared memory
``wait_for_save``                   worker     loads joined, saves committed
``get_transfer_results``            worker     background loads that ended (and failed,
                                               with several KV cache groups)
``get_block_ids_with_load_errors``  worker     blocks to recompute after a failed load
``get_kv_connector_stats``          worker     transfer counters for vLLM's metrics
==================================  =========  ==============================================

Roles (``kv_role``): ``kv_both`` loads and saves (prefix reuse), ``kv_producer`` saves
(prefill), ``kv_consumer`` loads (decode). Set ``kv_load_failure_policy: "recompute"`` so a
failed load costs time, never a request. Settings: :mod:`.settings`.

Hybrid attention: the connector implements ``SupportsHMA``, so vLLM keeps its hybrid KV
cache manager on (several KV cache groups, sliding-window blocks freed as the window
moves); :mod:`.groups` is the contract (one object per chunk and layer set, sliding-window
sets only where a consumer can use them, loads into live blocks only). A model with
recurrent state (Mamba, linear attention) starts and serves with the connector, which moves
nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .groups import layer_plan
from .metadata import KVFabricMetadata
from .namespace import Namespaces, engine_kv_dtype, model_id_of, spec_from_vllm
from .scheduler import SchedulerSide
from .settings import ConnectorSettings
from .stats import KVFabricConnectorStats
from .worker import WorkerSide


class KVFabricConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        spec = spec_from_vllm(vllm_config, settings.chunk_tokens, settings.kv_dtype)
        plan = layer_plan(kv_cache_config)
        moves = plan is None or not plan.inert
        namespaces = Namespaces(
            model_id_of(vllm_config, settings.model_id), spec, plan if moves else None
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                settings,
                namespaces,
                loads=transfer.is_kv_consumer and moves,
                saves=transfer.is_kv_producer and moves,
            )
            events = getattr(vllm_config, "kv_events_config", None)
            if events is not None and events.enable_kv_cache_events:
                self._scheduler.publish_events(vllm_config.cache_config.block_size)
        else:
            self._worker = WorkerSide(
                settings,
                namespaces,
                vllm_config.cache_config.block_size,
                engine_kv_dtype(vllm_config),
                moves=moves,
            )

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA's ``request_finished``: saves never outlive their step, so the block ids of
        the groups are not needed here either."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind_blocks(
                kv_cache_manager.get_block_ids, kv_cache_manager.block_pool.null_block.block_id
            )

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        split = self._scheduler.hit_sources(request, num_external_tokens)
        return {CacheHitSource(source): tokens for source, tokens in split.items()}

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The fabric's blocks for vLLM's KV event publisher (engines started with
        ``--kv-events-config``): :mod:`.events`."""
        assert self._scheduler is not None
        return () if self._scheduler.events is None else self._scheduler.events.take()

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(self._metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.finish_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Background loads that ended; with several KV cache groups those that failed too
        (vLLM recomputes them: it cannot map block ids of several groups to requests)."""
        assert self._worker is not None
        done, failed = self._worker.take_load_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed_blocks()

    def get_kv_connector_stats(self) -> KVFabricConnectorStats | None:
        return None if self._worker is None else self._worker.counters.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVFabricConnectorStats | None:
        return KVFabricConnectorStats(data=dict(data or {}))

    def transfer_totals(self) -> dict[str, float]:
        """Worker side: counters since start (loaded/saved chunks and tokens, errors)."""
        return {} if self._worker is None else self._worker.counters.totals()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _metadata(self) -> KVFabricMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFabricMetadata)
        return meta
