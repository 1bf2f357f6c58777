"""fp8 (e4m3) storage with per-(layer, k|v, head) float32 scales: scales, the stated error
bound, the serialized form and the bytes it saves."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.convert import fp8
from kvfabric.errors import PayloadSizeError, SpecError
from kvfabric.spec import KVSpec

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FP8 = torch.float8_e4m3fn


def reference_dequantize(layer: fp8.QuantizedLayer, dtype: torch.dtype) -> torch.Tensor:
    """The definition: e4m3 value times scale in float32, rounded once to ``dtype``."""
    return (layer.data.to(torch.float32) * layer.scales[:, :, None, None]).to(dtype)


def headline_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """|x| * 2**-4 + scale * 2**-10, in float64, written out independently of fp8.py."""
    return x.double().abs() / 16 + scales.double()[:, :, None, None] / 1024


# ---------------------------------------------------------------- tensors hypothesis draws


def finite_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


@st.composite
def kv_layers(draw: st.DrawFn, dtypes: list[torch.dtype] = DTYPES) -> torch.Tensor:
    """A canonical layer whose heads are each one of: zeros, all equal, random at some
    magnitude (huge to subnormal), or a list of arbitrary floats (hypothesis' own extremes)."""
    dtype = draw(st.sampled_from(dtypes))
    planes, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    tokens, dim = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    limit = finite_max(dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = np.empty((planes, heads, tokens * dim), dtype=np.float64)
    for plane in range(planes):
        for head in range(heads):
            kind = draw(st.sampled_from(["zeros", "equal", "random", "floats"]))
            if kind == "zeros":
                out[plane, head] = 0.0
            elif kind == "equal":
                out[plane, head] = draw(st.floats(-limit, limit, width=32))
            elif kind == "random":
                exponent = draw(st.integers(-150, 127))
                out[plane, head] = rng.standard_normal(tokens * dim) * 2.0**exponent
                out[plane, head, rng.random(tokens * dim) < 0.2] = 0.0
            else:
                values = draw(
                    st.lists(
                        st.floats(-limit, limit, width=32),
                        min_size=tokens * dim,
                        max_size=tokens * dim,
                    )
                )
                out[plane, head] = values
    out = np.clip(out, -limit, limit)  # what the producer's dtype can hold
    return torch.from_numpy(out.reshape(planes, heads, tokens, dim)).to(dtype)


FAST = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FAST
@given(x=kv_layers())
def test_error_bound_holds_for_float32_output(x: torch.Tensor) -> None:
    layer = fp8.quantize(x)
    back = fp8.dequantize(*layer, dtype=torch.float32)
    error = (x.double() - back.double()).abs()
    bound = headline_bound(x, layer.scales)
    worst = torch.argmax(error - bound)
    assert bool((error <= bound).all()), (
        f"x={x.double().view(-1)[worst]!r} got {back.double().view(-1)[worst]!r} "
        f"bound {bound.view(-1)[worst]!r}"
    )
    assert torch.equal(bound, fp8.error_bound(x, layer.scales))


@FAST
@given(x=kv_layers(), out_dtype=st.sampled_from(DTYPES))
def test_error_bound_widened_by_the_output_rounding(
    x: torch.Tensor, out_dtype: torch.dtype
) -> None:
    if float(x.double().abs().max()) > finite_max(out_dtype):
        return  # beyond the output dtype's range: inf by definition, not an fp8 error
    layer = fp8.quantize(x)
    back = fp8.dequantize(*layer, dtype=out_dtype)
    assert torch.isfinite(back).all()
    error = (x.double() - back.double()).abs()
    assert bool((error <= fp8.error_bound(x, layer.scales, out_dtype)).all())


@FAST
@given(x=kv_layers(), out_dtype=st.sampled_from(DTYPES))
def test_dequantize_is_bit_identical_to_the_float_definition(
    x: torch.Tensor, out_dtype: torch.dtype
) -> None:
    layer = fp8.quantize(x)
    got = fp8.dequantize(*layer, dtype=out_dtype)
    want = reference_dequantize(layer, out_dtype)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bits, signed zeros too


@FAST
@given(x=kv_layers())
def test_scales_are_amax_over_448_and_every_code_is_finite(x: torch.Tensor) -> None:
    layer = fp8.quantize(x)
    amax = x.double().abs().amax(dim=(2, 3))
    want = (amax / 448).clamp(min=fp8.MIN_SCALE).where(amax > 0, torch.ones_like(amax))
    assert torch.equal(layer.scales, want.float())
    assert layer.data.dtype == FP8 and layer.data.shape == x.shape
    codes = layer.data.view(torch.uint8)
    assert not bool(((codes & 0x7F) == 0x7F).any())  # no NaN code
    assert float(layer.data.float().abs().max()) <= 448


def test_special_heads() -> None:
    x = torch.zeros(2, 3, 4, 8)
    x[0, 1] = 5.0  # all equal
    x[1, 0] = torch.linspace(-1e30, 1e30, 32).view(4, 8)  # huge
    x[1, 2] = torch.linspace(-1e-40, 1e-40, 32).view(4, 8)  # float32 subnormals
    layer = fp8.quantize(x)
    assert layer.scales[0, 0] == 1.0 and layer.scales[0, 2] == 1.0  # zero heads
    assert torch.equal(fp8.dequantize(*layer, dtype=torch.float32)[0, 0], x[0, 0])
    assert float(layer.scales[0, 1]) == pytest.approx(5 / 448)
    assert torch.allclose(fp8.dequantize(*layer, dtype=torch.float32)[0, 1], x[0, 1])
    assert layer.data[0, 1].float().eq(448).all()  # the amax lands on e4m3's largest value
    assert float(layer.scales[1, 2]) == fp8.MIN_SCALE  # floor: 1 / scale stays finite
    back = fp8.dequantize(*layer, dtype=torch.float32)
    assert bool(((x.double() - back.double()).abs() <= headline_bound(x, layer.scales)).all())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = torch.zeros(2, 1, 2, 2)
    x[1, 0, 1, 1] = bad
    with pytest.raises(ValueError, match="non-finite"):
        fp8.quantize(x)


def test_wrong_inputs_are_refused() -> None:
    with pytest.raises(SpecError):
        fp8.quantize(torch.zeros(2, 1, 2, 2, dtype=torch.float64))
    with pytest.raises(PayloadSizeError):
        fp8.quantize(torch.zeros(2, 2, 2))  # not [planes, heads, tokens, dim]
    layer = fp8.quantize(torch.randn(2, 2, 3, 4))
    with pytest.raises(PayloadSizeError):
        fp8.dequantize(layer.data, layer.scales[:1])
    with pytest.raises(SpecError):
        fp8.dequantize(layer.data.float(), layer.scales)  # not fp8 data
    with pytest.raises(SpecError):
        fp8.dequantize(*layer, dtype="int8")
    with pytest.raises(PayloadSizeError):
        fp8.dequantize(*layer, dtype=torch.bfloat16, out=torch.empty(2, 2, 3, 4))  # wrong dtype
    with pytest.raises(PayloadSizeError):
        fp8.dequantize(*layer, dtype=torch.float32, out=torch.empty(2, 2, 3, 5))  # wrong shape


def test_dequantize_into_out() -> None:
    x = torch.randn(2, 2, 5, 8).to(torch.bfloat16)
    layer = fp8.quantize(x)
    out = torch.empty(2, 2, 5, 8, dtype=torch.float16)
    assert fp8.dequantize(*layer, dtype="fp16", out=out) is out
    assert torch.equal(out, reference_dequantize(layer, torch.float16))


def test_huge_scales_dequantize_without_overflow() -> None:
    x = torch.full((1, 1, 2, 2), 3.0e38)  # scale ~ 6.7e35: scale * 2**120 overflows float32
    x[0, 0, 0, 0] = -1.0e38
    layer = fp8.quantize(x)
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8.dequantize(*layer, dtype=dtype)
        assert torch.isfinite(got).all()
        assert torch.equal(got, reference_dequantize(layer, dtype))


# ---------------------------------------------------------------------- serialized form


@pytest.mark.parametrize("shape", [(2, 8, 256, 128), (1, 1, 256, 576), (2, 3, 1, 1)])
def test_serialized_size(shape: tuple[int, int, int, int]) -> None:
    planes, heads, tokens, dim = shape
    assert fp8.serialized_nbytes(shape) == planes * heads * 4 + planes * heads * tokens * dim
    with pytest.raises(PayloadSizeError):
        fp8.serialized_nbytes(shape[:3])


def test_serialized_layout_is_one_record_per_head_scale_first() -> None:
    x = torch.randn(2, 3, 4, 5) * torch.arange(1, 7).view(2, 3, 1, 1)
    layer = fp8.quantize(x)
    raw = fp8.encode_layer(x)
    assert raw.dtype == torch.uint8 and raw.numel() == fp8.serialized_nbytes(x.shape)
    record = 4 + 4 * 5
    for index, (plane, head) in enumerate((p, h) for p in range(2) for h in range(3)):
        at = raw[index * record : (index + 1) * record].numpy().tobytes()
        (scale,) = struct.unpack("<f", at[:4])  # little-endian, [plane][head] order
        assert scale == float(layer.scales[plane, head])
        assert at[4:] == layer.data[plane, head].contiguous().view(torch.uint8).numpy().tobytes()
    assert torch.equal(fp8.pack(layer), raw)
    # heads [1, 3): one run per plane, scales included, which together are the
    # serialized form of the [2, 2, 4, 5] sub-layer
    runs = [raw[(plane * 3 + 1) * record : (plane * 3 + 3) * record] for plane in range(2)]
    sub = fp8.unpack(torch.cat(runs), (2, 2, 4, 5))
    assert torch.equal(sub.scales, layer.scales[:, 1:3])
    assert torch.equal(sub.data.view(torch.uint8), layer.data[:, 1:3].view(torch.uint8))


def test_unpack_views_the_values_and_decode_round_trips() -> None:
    x = torch.randn(2, 2, 8, 16).to(torch.bfloat16)
    raw = fp8.encode_layer(x)
    view = fp8.unpack(raw, x.shape)
    assert view.data.data_ptr() == raw.data_ptr() + 4  # after the first head's scale
    assert torch.equal(fp8.pack(view), raw)
    assert torch.equal(fp8.decode_layer(raw, x.shape), fp8.dequantize(*fp8.quantize(x)))
    # from the bytes a store would hand back (read-only numpy, or plain bytes)
    frozen = raw.numpy().tobytes()
    assert torch.equal(
        fp8.decode_layer(frozen, x.shape, torch.float32), fp8.dequantize(*view, dtype=torch.float32)
    )
    with pytest.raises(PayloadSizeError):
        fp8.unpack(raw[:-1], x.shape)


def test_encode_into_a_callers_buffer() -> None:
    x = torch.randn(2, 4, 6, 8, dtype=torch.float16)
    buf = np.zeros(fp8.serialized_nbytes(x.shape), dtype=np.uint8)  # e.g. a store's page
    raw = fp8.encode_layer(x, out=buf)
    assert raw.data_ptr() == buf.ctypes.data
    assert torch.equal(
        fp8.decode_layer(buf, x.shape, torch.float16),
        fp8.dequantize(*fp8.quantize(x), dtype=torch.float16),
    )
    with pytest.raises(PayloadSizeError):
        fp8.encode_layer(x, out=np.zeros(10, dtype=np.uint8))


# ---------------------------------------------------------------------------- savings


def test_bytes_saved_and_chunk_size() -> None:
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    bf16 = spec.chunk_bytes
    fp8_bytes = 32 * (2 * 8 * 4 + 2 * 8 * 256 * 128)
    assert fp8.chunk_nbytes(spec) == fp8_bytes
    assert fp8.bytes_saved(spec) == bf16 - fp8_bytes
    assert fp8.bytes_saved(spec) / bf16 == pytest.approx(0.5, abs=1e-3)
    assert fp8.bytes_saved(spec, baseline="float32") == 2 * bf16 - fp8_bytes
    assert fp8.bytes_saved(spec, 16) == spec.layout(16).nbytes - fp8.chunk_nbytes(spec, 16)
    fp32 = KVSpec(num_layers=2, num_kv_heads=1, head_dim=576, dtype="float32", kind="mla")
    assert fp8.bytes_saved(fp32) == 2 * 256 * 576 * 2 - fp8.chunk_nbytes(fp32)  # vs bf16
    assert fp8.chunk_nbytes(fp32) == 2 * (4 + 256 * 576)
