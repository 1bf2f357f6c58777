"""kvfabric as a vLLM ``KVConnectorBase_V1`` plugin.

Load it with ``--kv-transfer-config '{"kv_connector": "KVFabricConnector",
"kv_connector_module_path": "kvfabric_connectors.vllm", "kv_role": "kv_both"}'``.
"""

from .connector import KVFabricConnector

__all__ = ["KVFabricConnector"]
