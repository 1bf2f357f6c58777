"""The kvfabric namespace of a vLLM request: model, KV spec, tenant (``cache_salt``), LoRA.

Both connector roles derive it the same way, so the scheduler's lookups and the worker's
loads and saves address the same chunks; engines with other block sizes share them, since
chunks are kvfabric's own (``chunk_tokens``), not engine blocks.

The canonical object holds every KV head of the model, whatever an engine's tensor
parallelism; :func:`rank_share` is the part of it one tensor-parallel rank's cache holds,
saves and loads (see :mod:`.worker`).

With vLLM's hybrid KV cache manager an engine's layers split into layer sets, one
namespace each (:mod:`.groups`): ``get(..., layer_set=s)``; set 0 is the full-attention
one where the model has it, the namespace of an engine without HMA when that is all.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.payload import HeadRange
from kvfabric.readspec import tp_head_range, tp_writes
from kvfabric.spec import AttentionKind, KVDtype, KVSpec, Namespace

from .groups import LayerPlan


def engine_kv_dtype(vllm_config: Any) -> torch.dtype:
    """The dtype of this engine's paged KV cache."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(
            f"kv_cache_dtype={cache_dtype!r} is not supported by this connector "
            f"yet (it moves the model's KV dtype)"
        )
    dtype = vllm_config.model_config.dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"cannot tell the KV dtype from model dtype {dtype!r}")
    return dtype


def spec_from_vllm(vllm_config: Any, chunk_tokens: int, kv_dtype: str | None = None) -> KVSpec:
    """The canonical spec of the model this engine serves (all KV heads: the object is
    the whole layer, whatever this engine's tensor parallelism). ``kv_dtype`` is the
    fabric's storage dtype when it differs from the engine's (a bf16 prefill feeding an fp32
    decode, or float8_e4m3fn: quantized with per-head scales): the connector converts at
    its edge."""
    model = vllm_config.model_config
    engine = engine_kv_dtype(vllm_config)
    engine_kind = KVDtype.parse(str(engine))
    stored = KVDtype.parse(kv_dtype) if kv_dtype else engine_kind
    if not (engine_kind.is_float and stored.reads_as(engine_kind)):
        raise ValueError(f"cannot convert between KV dtypes {engine} and {stored.value}")
    mla = bool(getattr(model, "use_mla", False))
    return KVSpec(
        num_layers=model.get_num_layers(vllm_config.parallel_config),
        num_kv_heads=1 if mla else model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        dtype=stored,
        kind=AttentionKind.MLA if mla else AttentionKind.MHA,
        chunk_tokens=chunk_tokens,
    )


def model_id_of(vllm_config: Any, configured: str | None) -> str:
    if configured:
        return configured
    model = vllm_config.model_config
    return str(model.served_model_name or model.model)


def lora_id_of(request: Any) -> str:
    lora = getattr(request, "lora_request", None)
    return "" if lora is None else str(lora.lora_name)


class Namespaces:
    """Interned namespaces of one engine: (tenant salt, LoRA id, layer set) -> Namespace.

    ``plan``: the engine's KV cache groups (:mod:`.groups`); None or a single full-attention
    group: one set, every layer, the model id as given. ``spec`` is the whole model's."""

    def __init__(self, model_id: str, spec: KVSpec, plan: LayerPlan | None = None) -> None:
        self.model_id = model_id
        self.spec = spec
        self.plan = None if plan is None or plan.legacy else plan

    @property
    def num_sets(self) -> int:
        return 1 if self.plan is None else len(self.plan.sets)

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one instance per engine)
    def get(self, tenant_salt: str, lora_id: str, layer_set: int = 0) -> Namespace:
        if self.plan is None:
            return Namespace(self.model_id, self.spec, tenant_salt, lora_id)
        members = self.plan.sets[layer_set]
        spec = dataclasses.replace(self.spec, num_layers=len(members.layers))
        return Namespace(self.model_id + members.tag(), spec, tenant_salt, lora_id)


@dataclass(frozen=True)
class RankShare:
    """The part of the canonical object one tensor-parallel rank's KV cache holds.

    ``heads``: its KV-head range, or None for all of them (no tensor parallelism, or MLA's
    latent, which every rank replicates). ``saves``: whether this rank writes its range; of
    ranks holding the same heads (replicas) only the first does. ``pushes``: whether it
    pushes a producer's chunks on to another node (one rank does that for all)."""

    heads: HeadRange | None
    saves: bool
    pushes: bool

    def num_heads(self, spec: KVSpec) -> int:
        """KV heads in this rank's cache."""
        return spec.num_kv_heads if self.heads is None else self.heads[1] - self.heads[0]


def rank_share(spec: KVSpec, tp_rank: int, tp_size: int) -> RankShare:
    """Rank ``tp_rank`` of ``tp_size``: its KV heads and whether it saves them, as
    :func:`kvfabric.readspec.tp_head_range` / :func:`~kvfabric.readspec.tp_writes` split the
    canonical object (GQA replication and MLA included); rank 0 pushes."""
    heads = tp_head_range(spec, tp_rank, tp_size)
    whole = heads == (0, spec.num_kv_heads)
    return RankShare(None if whole else heads, tp_writes(spec, tp_rank, tp_size), tp_rank == 0)
