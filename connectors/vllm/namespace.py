"""The kvfabric namespace of a vLLM request: model, KV spec, tenant (``cache_salt``), LoRA.

Both connector roles derive it the same way, so the scheduler's lookups and the worker's
loads and saves address the same chunks; engines with other block sizes share them, since
chunks are kvfabric's own (``chunk_tokens``), not engine blocks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvfabric.spec import AttentionKind, KVSpec, Namespace


CONVERTIBLE = (torch.bfloat16, torch.float16, torch.float32)


def engine_kv_dtype(vllm_config: Any) -> torch.dtype:
    """The dtype of this engine's paged KV cache."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(f"kv_cache_dtype={cache_dtype!r} is not supported by this connector "
                         f"yet (it moves the model's KV dtype)")
    dtype = vllm_config.model_config.dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"cannot tell the KV dtype from model dtype {dtype!r}")
    return dtype


def spec_from_vllm(vllm_config: Any, chunk_tokens: int, kv_dtype: str | None = None
                   ) -> KVSpec:
    """The canonical spec of the model this engine serves (all KV heads: the object is
    the whole layer, whatever this engine's tensor parallelism). ``kv_dtype`` is the
    fabric's storage dtype when it differs from the engine's (a bf16 prefill feeding an fp32
    decode): the connector converts at its edge."""
    model = vllm_config.model_config
    engine = engine_kv_dtype(vllm_config)
    stored = getattr(torch, kv_dtype) if kv_dtype else engine
    if {engine, stored} - set(CONVERTIBLE):
        raise ValueError(f"cannot convert between KV dtypes {engine} and {stored}")
    mla = bool(getattr(model, "use_mla", False))
    return KVSpec(num_layers=model.get_num_layers(vllm_config.parallel_config),
                  num_kv_heads=1 if mla else model.get_total_num_kv_heads(),
                  head_dim=model.get_head_size(), dtype=str(stored),
                  kind=AttentionKind.MLA if mla else AttentionKind.MHA,
                  chunk_tokens=chunk_tokens)


def model_id_of(vllm_config: Any, configured: str | None) -> str:
    if configured:
        return configured
    model = vllm_config.model_config
    return str(model.served_model_name or model.model)


def lora_id_of(request: Any) -> str:
    lora = getattr(request, "lora_request", None)
    return "" if lora is None else str(lora.lora_name)


class Namespaces:
    """Interned namespaces of one engine: (tenant salt, LoRA id) -> Namespace."""

    def __init__(self, model_id: str, spec: KVSpec) -> None:
        self.model_id = model_id
        self.spec = spec

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one instance per engine)
    def get(self, tenant_salt: str, lora_id: str) -> Namespace:
        return Namespace(self.model_id, self.spec, tenant_salt, lora_id)
