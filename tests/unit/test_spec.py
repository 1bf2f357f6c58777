"""KVSpec, Namespace and ChunkLayout: validation, fingerprints, canonical byte geometry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfabric.errors import SpecError
from kvfabric.spec import AttentionKind, KVDtype, KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=16)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "chunk_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes_are_rejected(field: str, value: int) -> None:
    args = SPEC.to_dict() | {field: value}
    with pytest.raises(SpecError, match=field):
        KVSpec(**args)


def test_non_integer_and_absurd_sizes_are_rejected() -> None:
    with pytest.raises(SpecError, match="integer"):
        KVSpec(num_layers=2.5, num_kv_heads=2, head_dim=64)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="limit"):
        KVSpec(num_layers=4, num_kv_heads=2, head_dim=1 << 20)


def test_unknown_dtype_names_the_choices() -> None:
    with pytest.raises(SpecError, match="unknown KV dtype 'int4'.*bfloat16"):
        KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="int4")


def test_dtype_aliases_and_torch_names() -> None:
    assert KVDtype.parse("torch.bfloat16") is KVDtype.BFLOAT16
    assert KVDtype.parse("fp16") is KVDtype.FLOAT16
    assert KVDtype.parse("fp8") is KVDtype.FLOAT8_E4M3
    assert KVDtype.FLOAT32.itemsize == 4


def test_chunk_size_must_be_a_multiple_of_engine_block_size() -> None:
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=256)
    spec.check_block_size(128)
    spec.check_block_size(256)
    with pytest.raises(SpecError, match="not a multiple of the engine block size 96"):
        spec.check_block_size(96)


def test_mla_has_one_latent_plane() -> None:
    mla = KVSpec(num_layers=2, num_kv_heads=1, head_dim=576, kind="mla", chunk_tokens=64)
    assert mla.kind is AttentionKind.MLA and mla.kv_planes == 1
    assert mla.chunk_bytes == 2 * 64 * 576 * 2
    with pytest.raises(SpecError, match="MLA"):
        KVSpec(num_layers=2, num_kv_heads=4, head_dim=576, kind="mla")


def test_fingerprint_is_stable_across_processes() -> None:
    # Pinned value: the fingerprint is part of every key, it must never drift.
    assert SPEC.fingerprint.hex() == "afdf935853218a429825e17bc9ea5df7"
    code = (
        "from kvfabric.spec import KVSpec;"
        "print(KVSpec(4, 2, 64, 'bfloat16', chunk_tokens=16).fingerprint.hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout.strip()
    assert out == SPEC.fingerprint.hex()


def test_fingerprint_changes_with_every_field() -> None:
    variants = [
        SPEC.to_dict() | change
        for change in (
            {"num_layers": 5},
            {"num_kv_heads": 4},
            {"head_dim": 128},
            {"dtype": "float16"},
            {"chunk_tokens": 32},
        )
    ]
    prints = {KVSpec(**v).fingerprint for v in variants} | {SPEC.fingerprint}
    assert len(prints) == len(variants) + 1


def test_from_dict_round_trip_and_unknown_fields() -> None:
    assert KVSpec.from_dict(SPEC.to_dict()) == SPEC
    with pytest.raises(SpecError, match="unknown KVSpec field"):
        KVSpec.from_dict(SPEC.to_dict() | {"heads": 3})


def test_layout_is_layer_major_then_plane_then_head() -> None:
    layout = SPEC.layout()  # 16 tokens, 2 heads, 64 dim, bf16
    assert layout.head_bytes == 16 * 64 * 2
    assert layout.plane_bytes == 2 * layout.head_bytes
    assert layout.layer_bytes == 2 * layout.plane_bytes
    assert layout.nbytes == 4 * layout.layer_bytes
    assert layout.layer_range(2) == (2 * layout.layer_bytes, layout.layer_bytes)
    # head 1 of layer 1: one run in the K plane, one in the V plane
    base = layout.layer_bytes
    assert layout.head_ranges(1, 1, 2) == [
        (base + layout.head_bytes, layout.head_bytes),
        (base + layout.plane_bytes + layout.head_bytes, layout.head_bytes),
    ]


def test_partial_chunk_layout_and_bounds() -> None:
    assert SPEC.layout(5).nbytes == 4 * 2 * 2 * 5 * 64 * 2
    with pytest.raises(SpecError):
        SPEC.layout(17)
    with pytest.raises(SpecError):
        SPEC.layout(0)
    with pytest.raises(SpecError, match="layer 4"):
        SPEC.layout().layer_range(4)
    with pytest.raises(SpecError, match="head range"):
        SPEC.layout().head_ranges(0, 1, 3)


def test_namespace_seed_separates_every_component() -> None:
    base = Namespace("m", SPEC)
    others = [
        Namespace("m2", SPEC),
        Namespace("m", SPEC, tenant_salt="t"),
        Namespace("m", SPEC, lora_id="l"),
        Namespace("m", KVSpec(**(SPEC.to_dict() | {"dtype": "float16"}))),
    ]
    assert len({base.seed, *(o.seed for o in others)}) == 5
    # length prefixes: moving a byte between fields changes the seed
    assert Namespace("ab", SPEC, tenant_salt="c").seed != Namespace("a", SPEC, "bc").seed


def test_namespace_validation() -> None:
    with pytest.raises(SpecError, match="model_id"):
        Namespace("", SPEC)
    with pytest.raises(SpecError, match="spec"):
        Namespace("m", {"num_layers": 1})  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="tenant_salt"):
        Namespace("m", SPEC, tenant_salt="x" * 5000)
