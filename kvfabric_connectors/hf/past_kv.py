"""The fabric's KV of a prompt as transformers ``past_key_values``.

A decode worker that is not a vLLM engine (a CPU node running plain PyTorch for long-tail
decode, a research harness, a scorer) continues a prompt from the KV a prefill engine put
into the fabric. :func:`load_past_key_values` pins the prompt's chunks at the node's daemon
(having the daemon pull first what only another node holds), copies the longest stored prefix
out of the canonical ``[layer][k|v][kv_head][token][head_dim]`` payloads into one
``[1, kv_heads, tokens, head_dim]`` K and V per layer, converted to the dtype the consumer
model runs in, and hands them over as the cache object the installed transformers uses
(a ``DynamicCache``).

Both sides agree on what a cached K is: vLLM and transformers' Llama cache K after the rotary
embedding (and V as projected), per KV head, without the GQA repeat. So the stored KV feeds
the model's attention as is, at the positions it was computed for.

The namespace must be the producer's: its model id (vLLM's served model name unless the
connector's ``model_id`` is set), its KV dtype and chunk size (see :func:`namespace_for`).
A consumer that runs in another dtype (bf16 KV into an fp32 model) asks for ``dtype=``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfabric.client import Client
from kvfabric.client.objects import RemoteReader
from kvfabric.convert.dtype import read_layer
from kvfabric.errors import KVFabricError, SpecError, UnsupportedError
from kvfabric.hashing import ChunkRef, chunk_hashes
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, AttentionKind, KVDtype, KVSpec, Namespace

DEFAULT_TIMEOUT_S = 10.0


@dataclass
class FabricPrefix:
    """What :func:`load_past_key_values` found: the cache and where it came from."""

    past_key_values: Any  # transformers DynamicCache holding ``num_tokens`` tokens per layer
    num_tokens: int  # prompt tokens covered (the longest stored prefix, capped by max_tokens)
    chunks: int  # chunks read
    pulled: int = 0  # of those, chunks the daemon pulled from another node first
    source: str | None = None  # the node they were pulled from
    stats: dict[str, Any] = field(default_factory=dict)  # the prefetch reply, if any


def torch_dtype(spec: KVSpec) -> torch.dtype:
    """The torch dtype of a spec's canonical payload."""
    dtype: torch.dtype = getattr(torch, spec.dtype.value)
    return dtype


def spec_from_config(
    config: Any, *, dtype: str | torch.dtype = "bfloat16", chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> KVSpec:
    """The canonical KV spec of a transformers decoder config (Llama-like: MHA/GQA).

    ``dtype`` is the dtype the KV is *stored* in (the producer's), not necessarily the one
    the consumer runs in."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
    return KVSpec(
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        dtype=KVDtype.parse(str(dtype).removeprefix("torch.")),
        chunk_tokens=chunk_tokens,
    )


def namespace_for(
    model_id: str,
    config: Any,
    *,
    dtype: str | torch.dtype = "bfloat16",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    tenant_salt: str = "",
    lora_id: str = "",
) -> Namespace:
    """The namespace a vLLM ``KVFabricConnector`` producer stores this model's KV under:
    ``model_id`` = its served model name (or the connector's ``model_id``), ``dtype`` its
    model dtype, ``tenant_salt`` the request's ``cache_salt``."""
    return Namespace(
        model_id,
        spec_from_config(config, dtype=dtype, chunk_tokens=chunk_tokens),
        tenant_salt,
        lora_id,
    )


def check_config(spec: KVSpec, config: Any) -> None:
    """Raise :class:`SpecError` unless the model of ``config`` has the KV shape of ``spec``."""
    own = spec_from_config(config, dtype=spec.dtype.value, chunk_tokens=spec.chunk_tokens)
    if (own.num_layers, own.num_kv_heads, own.head_dim) != (
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
    ):
        raise SpecError(
            f"the model has {own.num_layers} layers x {own.num_kv_heads} KV heads "
            f"x {own.head_dim}, the namespace {spec.num_layers} x "
            f"{spec.num_kv_heads} x {spec.head_dim}"
        )


def load_past_key_values(
    client: Client,
    ns: Namespace,
    token_ids: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: Any = None,
    max_tokens: int | None = None,
    pull: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> FabricPrefix:
    """The KV of the longest prefix of ``token_ids`` the fabric holds, as ``past_key_values``.

    ``max_tokens`` caps the prefix (a decode that still needs the logits of the last prompt
    token asks for ``len(token_ids) - 1``). Chunks this node lacks are pulled from the node
    that holds them when ``pull`` (the daemon must be in a cluster; elsewhere the local
    prefix is all there is). Each chunk is pinned while it is copied out and released after;
    a chunk still being written is read layer by layer as its layers are committed. The
    whole call (pins, pull, waits) takes at most about ``timeout`` seconds. ``dtype``
    converts (default: the stored dtype; bfloat16 for fp8); ``config`` (the model's) is
    checked against the namespace's spec and passed to the cache.
    """
    spec = ns.spec
    if spec.kind is not AttentionKind.MHA:
        raise SpecError(
            "transformers past_key_values hold K and V per head: MLA is not supported here"
        )
    if config is not None:
        check_config(spec, config)
    limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
    refs = _covering(chunk_hashes(ns, list(token_ids)), limit) if limit else []
    deadline = time.monotonic() + timeout
    readers: list[RemoteReader | None] = []
    reply: dict[str, Any] = {}
    try:
        readers, reply = _pin(client, ns, refs, pull, deadline)
        stored = _prefix(readers)
        found = min(limit, sum(ref.num_tokens for ref in refs[:stored]))
        layers = _copy_out(readers[:stored], refs[:stored], spec, found, dtype, device, deadline)
    finally:
        if readers:
            try:
                client.release_many(readers)
            except (KVFabricError, OSError):
                pass  # the pins expire with their leases
    pulled = int(reply.get("pulled", 0))
    return FabricPrefix(
        make_cache(layers, config),
        found,
        stored,
        pulled,
        reply.get("source") if pulled else None,
        reply,
    )


def make_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], config: Any = None) -> Any:
    """A transformers cache holding ``layers`` ((K, V) of shape [batch, kv_heads, tokens,
    head_dim] per layer); empty when ``layers`` is."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # a transformers without per-model cache layers
        cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


def _covering(refs: list[ChunkRef], tokens: int) -> list[ChunkRef]:
    """The leading chunks that hold the first ``tokens`` tokens."""
    out, covered = [], 0
    for ref in refs:
        if covered >= tokens:
            break
        out.append(ref)
        covered += ref.num_tokens
    return out


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _pin(
    client: Client, ns: Namespace, refs: list[ChunkRef], pull: bool, deadline: float
) -> tuple[list[RemoteReader | None], dict[str, Any]]:
    if not refs:
        return [], {}
    keys = [ref.key for ref in refs]
    # pull first: a get before it would count the chunks only another node holds as this
    # node's misses (and pin them twice); the daemon pulls only what it lacks, and one
    # outside a cluster is not asked at all
    reply = _prefetch(client, ns, keys, _left(deadline)) if pull and client.can_pull else None
    return client.get_many(ns, keys, timeout=_left(deadline)), reply or {}


def _prefetch(
    client: Client, ns: Namespace, keys: list[bytes], timeout: float
) -> dict[str, Any] | None:
    """The daemon's prefetch reply, or None where this node cannot pull (not in a cluster)."""
    try:
        return dict(client.prefetch(ns, keys=keys, timeout=timeout))
    except UnsupportedError:
        return None


def _prefix(readers: Sequence[RemoteReader | None]) -> int:
    count = 0
    for reader in readers:
        if reader is None:
            break
        count += 1
    return count


def _copy_out(
    readers: Sequence[RemoteReader | None],
    refs: Sequence[ChunkRef],
    spec: KVSpec,
    tokens: int,
    dtype: torch.dtype | None,
    device: str | torch.device,
    deadline: float,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [1, kv_heads, tokens, head_dim], from canonical payloads."""
    if tokens == 0:
        return []
    # fp8 objects have no plain tensor form: they come back dequantized, bf16 by default
    target = dtype or (torch.bfloat16 if spec.dtype is KVDtype.FLOAT8_E4M3 else torch_dtype(spec))
    heads, dim = spec.num_kv_heads, spec.head_dim
    out = []
    for layer in range(spec.num_layers):
        # [k|v][batch][kv_head][token][head_dim]: K and V are contiguous [1, H, T, D] each
        kv = torch.empty(2, 1, heads, tokens, dim, dtype=target, device=device)
        start = 0
        for reader, ref in zip(readers, refs):
            assert reader is not None
            take = min(ref.num_tokens, tokens - start)
            if take <= 0:
                break
            reader.wait_layer(layer, timeout=_left(deadline))
            # [2, heads, tokens, dim]: a view when nothing converts
            canonical = read_layer(reader, layer, dtype=target)
            kv[:, 0, :, start : start + take].copy_(canonical[:, :, :take])
            start += take
        out.append((kv[0], kv[1]))
    return out
