"""Conversions of canonical KV for heterogeneous consumers.

* :mod:`kvfabric.convert.dtype` -- bfloat16 / float16 / float32 conversion on read, straight
  from a reader's zero-copy pieces (a view when nothing changes), and on write
  (:func:`write_layer`); float8 objects are dequantized / quantized there too.
* :mod:`kvfabric.convert.pieces` -- the dtypes conversion handles and page pieces as tensors,
  shared by the other two.
* :mod:`kvfabric.convert.request` -- a read the way a consumer's
  :class:`~kvfabric.readspec.ReadSpec` asks (dtype, head range, layout).
* :mod:`kvfabric.convert.fp8` -- an fp8 (e4m3) storage format with per-(layer, k|v, head)
  float32 scales, its serialized form and its error bound.
"""

from kvfabric.convert.dtype import (
    convert_pieces,
    convert_tensor,
    layer_shape,
    read_layer,
    read_payload,
    write_layer,
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
    read_pieces,
    serialized_nbytes,
    unpack,
    write_pieces,
)
from kvfabric.convert.pieces import coalesce, kv_dtype, torch_dtype

__all__ = [
    "QuantizedLayer",
    "bytes_saved",
    "chunk_nbytes",
    "coalesce",
    "convert_pieces",
    "convert_tensor",
    "decode_layer",
    "dequantize",
    "encode_layer",
    "error_bound",
    "kv_dtype",
    "layer_shape",
    "pack",
    "quantize",
    "read_layer",
    "read_payload",
    "read_pieces",
    "serialized_nbytes",
    "torch_dtype",
    "unpack",
    "write_layer",
    "write_pieces",
]
