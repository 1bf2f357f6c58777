"""kvfabric for plain PyTorch / transformers decode (import package ``kvfabric_connectors.hf``).

:func:`load_past_key_values` turns the KV a prefill engine stored in the fabric into
transformers ``past_key_values`` (any dtype the consumer runs in); :func:`decode_from_fabric`
continues a prompt from it with a greedy decode loop on the CPU (or any torch device).
"""

from .decode import DecodeResult, decode_from_fabric, greedy_decode
from .past_kv import FabricPrefix, load_past_key_values, make_cache, namespace_for, spec_from_config

__all__ = [
    "DecodeResult",
    "FabricPrefix",
    "decode_from_fabric",
    "greedy_decode",
    "load_past_key_values",
    "make_cache",
    "namespace_for",
    "spec_from_config",
]
