"""kvfabric: a tiered KV-cache fabric for disaggregated LLM inference.

The library core: the KV data model (:mod:`kvfabric.spec`), chunk hashing
(:mod:`kvfabric.hashing`), shared-memory arenas (:mod:`kvfabric.memory`), storage tiers
(:mod:`kvfabric.tiers`) and the node-local tiered store (:mod:`kvfabric.store`).

The names below load on first use (PEP 562): importing any ``kvfabric.*`` module imports this
package first, and the command line (``kvfabric --help``) must not pay for numpy to start.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at start-up

__version__ = "0.1.0"

_LAZY = {
    "ROOT": "kvfabric.hashing",
    "ChunkRef": "kvfabric.hashing",
    "chunk_hashes": "kvfabric.hashing",
    "chunk_keys": "kvfabric.hashing",
    "AttentionKind": "kvfabric.spec",
    "ChunkLayout": "kvfabric.spec",
    "KVDtype": "kvfabric.spec",
    "KVSpec": "kvfabric.spec",
    "Namespace": "kvfabric.spec",
}

__all__ = [
    "ROOT",
    "AttentionKind",
    "ChunkLayout",
    "ChunkRef",
    "KVDtype",
    "KVSpec",
    "Namespace",
    "__version__",
    "chunk_hashes",
    "chunk_keys",
]

if TYPE_CHECKING:
    from typing import Any

    from kvfabric.hashing import ROOT, ChunkRef, chunk_hashes, chunk_keys
    from kvfabric.spec import AttentionKind, ChunkLayout, KVDtype, KVSpec, Namespace


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfabric' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
