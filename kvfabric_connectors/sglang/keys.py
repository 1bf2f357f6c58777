"""Where an SGLang page lives in kvfabric: its namespace and its 16-byte key.

SGLang names a page by a hex SHA-256 chained over the page's uint32 token ids and its
predecessor's hash (seeded by the request's own ``extra_key`` / ``cache_salt``), so a page
key already names its whole prefix. kvfabric keeps the first 16 bytes of that digest as the
chunk key (a truncated SHA-256 stays collision-resistant); keys of other shapes (SGLang's
``unified`` key scheme appends a layer/head coordinate) are hashed to 16 bytes with BLAKE2b.

The namespace separates what must never be shared: the model (``model_id``), the shard of
the KV this rank holds (TP rank and size for MHA, whose ranks hold disjoint KV heads; one
shard for MLA, whose latent is replicated on every rank; PP stage and attention-CP rank when
those split the page), the page geometry (the :class:`~kvfabric.spec.KVSpec`, whose
fingerprint covers layers, heads, head size, dtype and tokens per page) and the tenant
(``cache_salt`` of the extra config). Pure functions; thread-safe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kvfabric.hashing import KEY_BYTES, ROOT, ChunkRef
from kvfabric.spec import KVSpec, Namespace

_SHA256_HEX = 64
_HEX = frozenset("0123456789abcdefABCDEF")


def page_key(key: str) -> bytes:
    """The kvfabric chunk key of one SGLang page key."""
    if len(key) == _SHA256_HEX and _HEX.issuperset(key):
        return bytes.fromhex(key)[:KEY_BYTES]
    return hashlib.blake2b(key.encode(), digest_size=KEY_BYTES, person=b"kvfabric-sglang").digest()


def page_chunks(
    keys: Sequence[str], prefix_keys: Sequence[str] | None, page_tokens: int
) -> list[ChunkRef]:
    """Chunk refs of consecutive pages, each the child of the one before it.

    The first page's parent is the last of ``prefix_keys`` (SGLang passes them with
    ``hicache_storage_pass_prefix_keys``), or the root when SGLang did not say: the daemon
    uses parents only to evict chain tails before their heads.
    """
    parent = page_key(prefix_keys[-1]) if prefix_keys else ROOT
    refs = []
    for key in keys:
        chunk = page_key(key)
        refs.append(ChunkRef(chunk, parent, page_tokens))
        parent = chunk
    return refs


def shard_of(storage_config: Any) -> str:
    """The part of the KV this rank holds, from SGLang's ``HiCacheStorageConfig``."""
    c = storage_config
    parts = ["mla" if c.is_mla_model else f"tp{c.tp_rank}of{c.tp_size}"]
    if c.pp_size > 1:
        parts.append(f"pp{c.pp_rank}of{c.pp_size}")
    if c.attn_cp_size > 1:
        parts.append(f"cp{c.attn_cp_rank}of{c.attn_cp_size}")
    return "-".join(parts)


def namespace_for(model_id: str, storage_config: Any, spec: KVSpec, cache_salt: str) -> Namespace:
    """The namespace of every page this rank stores or loads."""
    return Namespace(f"{model_id}#sglang:{shard_of(storage_config)}", spec, tenant_salt=cache_salt)
