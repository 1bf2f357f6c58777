"""kvfabric as an SGLang HiCache storage backend.

Turn it on with ``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvfabric", "module_path":
"kvfabric_connectors.sglang", "class_name": "KVFabricHiCacheStorage", "interface_v1": 1}'``
(plus the optional keys of :mod:`.settings`).
"""

from .backend import KVFabricHiCacheStorage

__all__ = ["KVFabricHiCacheStorage"]
