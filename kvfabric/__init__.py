"""kvfabric: a tiered KV-cache fabric for disaggregated LLM inference.

The library core: the KV data model (:mod:`kvfabric.spec`), chunk hashing
(:mod:`kvfabric.hashing`), shared-memory arenas (:mod:`kvfabric.memory`), storage tiers
(:mod:`kvfabric.tiers`) and the node-local tiered store (:mod:`kvfabric.store`).
"""

from kvfabric.hashing import ROOT, ChunkRef, chunk_hashes, chunk_keys
from kvfabric.spec import AttentionKind, ChunkLayout, KVDtype, KVSpec, Namespace

__version__ = "0.1.0"

__all__ = ["ROOT", "AttentionKind", "ChunkLayout", "ChunkRef", "KVDtype", "KVSpec", "Namespace",
           "chunk_hashes", "chunk_keys", "__version__"]
