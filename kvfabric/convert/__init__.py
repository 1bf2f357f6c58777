"""Conversions of canonical KV for heterogeneous consumers.

* :mod:`kvfabric.convert.dtype` -- bfloat16 / float16 / float32 conversion on read, straight
  from a reader's zero-copy pieces (a view when nothing changes).
* :mod:`kvfabric.convert.fp8` -- an fp8 (e4m3) storage format with per-(layer, k|v, head)
  float32 scales, its serialized form and its error bound.
"""

from kvfabric.convert.dtype import (
                                    coalesce,
                                    convert_pieces,
                                    convert_tensor,
                                    kv_dtype,
                                    layer_shape,
                                    read_layer,
                                    read_payload,
                                    torch_dtype,
)
from kvfabric.convert.fp8 import (
                                    QuantizedLayer,
                                    bytes_saved,
                                    chunk_nbytes,
                                    decode_layer,
                                    dequantize,
                                    encode_layer,
                                    error_bound,
                                    pack,
                                    quantize,
                                    serialized_nbytes,
                                    unpack,
)

__all__ = ["QuantizedLayer", "bytes_saved", "chunk_nbytes", "coalesce", "convert_pieces",
           "convert_tensor", "decode_layer", "dequantize", "encode_layer", "error_bound",
           "kv_dtype", "layer_shape", "pack", "quantize", "read_layer", "read_payload",
           "serialized_nbytes", "torch_dtype", "unpack"]
