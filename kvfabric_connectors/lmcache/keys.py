"""How LMCache's chunks map onto kvfabric namespaces and 16-byte chunk keys.

LMCache hands a remote backend opaque chunks: the bytes of a memory object whose geometry
(shapes, dtypes, memory format per KV group) is fixed for one engine, holding up to
``chunk_size`` tokens at ``token_bytes`` bytes each. The plugin stores them as follows.

* **Spec** -- :func:`opaque_spec`: a kvfabric :class:`~kvfabric.spec.KVSpec` that describes
  exactly those bytes, not a model: one plane (``kind="mla"``, one "head") of 1-byte
  elements, ``chunk_tokens = chunk_size``, and ``num_layers x head_dim = token_bytes`` (the
  fewest "layers" that keep ``head_dim`` within kvfabric's limit). A chunk of ``n`` tokens is
  then ``n * token_bytes`` bytes, LMCache's byte order unchanged, so the daemon's
  ``num_tokens`` of an object is the token count of LMCache's (possibly unfull) chunk.
* **Namespace** -- (model id, that spec, tenant, LoRA id). The model id defaults to
  ``lmcache:<model_name>`` (the daemon's per-namespace metrics show LMCache traffic apart
  from other engines'); the tenant and LoRA id come from the plugin settings. The daemon
  enforces namespaces: another tenant's chunk is a miss even with the same key.
* **Key** -- :func:`chunk_key`: ``xxh3_128(ns.seed || "LMCK1" || layout || 0 || key)``, with
  ``layout`` the memory format, shapes and dtypes of a full chunk and ``key`` LMCache's
  canonical ``CacheEngineKey.to_string()``: ``model@world_size@worker_id@chunk_hash@dtype``
  plus its ``@tag%value`` tags. Different models, tenants, LoRAs, tensor-parallel ranks,
  dtypes, tags or chunk geometries never share a key; the same deployment on any node
  computes the same keys, so chunks are shared through the daemon's global index.

Every LMCache chunk is a root in kvfabric (parent = 16 zero bytes): an LMCache key does not
name its predecessor, so kvfabric's prefix-aware eviction treats them as independent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

from kvfabric.spec import MAX_HEAD_DIM, MAX_LAYERS, AttentionKind, KVDtype, KVSpec, Namespace

KEY_TAG = b"LMCK1"


def opaque_spec(token_bytes: int, chunk_tokens: int) -> KVSpec:
    """A spec whose chunk of ``n`` tokens is ``n * token_bytes`` bytes."""
    if token_bytes <= 0:
        raise ValueError(f"token_bytes must be positive, got {token_bytes}")
    for layers in range(1, MAX_LAYERS + 1):
        if token_bytes % layers == 0 and token_bytes // layers <= MAX_HEAD_DIM:
            return KVSpec(
                num_layers=layers,
                num_kv_heads=1,
                head_dim=token_bytes // layers,
                dtype=KVDtype.UINT8,
                kind=AttentionKind.MLA,
                chunk_tokens=chunk_tokens,
            )
    raise ValueError(
        f"an LMCache token of {token_bytes} bytes cannot be described as at "
        f"most {MAX_LAYERS} x {MAX_HEAD_DIM} bytes"
    )


def layout_tag(fmt: Any, shapes: Sequence[Any], dtypes: Sequence[Any]) -> bytes:
    """The full-chunk geometry, canonical: ``KV_2LTD|2x4x256x512|torch.bfloat16``."""
    name = getattr(fmt, "name", str(fmt))
    dims = ",".join("x".join(str(int(d)) for d in shape) for shape in shapes)
    kinds = ",".join(str(d) for d in dtypes)
    return f"{name}|{dims}|{kinds}".encode()


def namespace_for(
    model_name: str,
    spec: KVSpec,
    *,
    model_id: str | None = None,
    tenant: str = "",
    lora_id: str = "",
) -> Namespace:
    return Namespace(model_id or f"lmcache:{model_name}", spec, tenant_salt=tenant, lora_id=lora_id)


def chunk_key(ns: Namespace, layout: bytes, key_string: str) -> bytes:
    """The kvfabric key of the LMCache key whose ``to_string()`` is ``key_string``."""
    return xxhash.xxh3_128_digest(b"".join((ns.seed, KEY_TAG, layout, b"\0", key_string.encode())))
