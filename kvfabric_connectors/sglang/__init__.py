"""kvfabric as an SGLang HiCache storage backend.

Turn it on with ``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvfabric", "module_path":
"kvfabric_connectors.sglang", "class_name": "KVFabricHiCacheStorage", "interface_v1": 1}'``
(plus the optional keys of :mod:`.settings`).

The backend class loads on first use (PEP 562): :mod:`.settings` imports without SGLang
installed (the unit tests check it beside the other plugins' settings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["KVFabricHiCacheStorage"]

if TYPE_CHECKING:
    from .backend import KVFabricHiCacheStorage


def __getattr__(name: str) -> Any:
    if name == "KVFabricHiCacheStorage":
        from .backend import KVFabricHiCacheStorage

        return KVFabricHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
