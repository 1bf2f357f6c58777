"""Chained chunk hashing: golden vectors, chain structure, partial chunks, stability."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric import hashing
from kvfabric.errors import SpecError
from kvfabric.hashing import ROOT, as_token_array, chunk_hashes, chunk_keys
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("tiny-llama", SPEC)

# Pinned: changing these breaks every stored object and every peer's index.
GOLDEN_SEED = "c544d438caeccb6b245f98ce5a4f9918"
GOLDEN_0_40 = [
    "f643716c730a62090d72c18137cc293c",
    "c5606c7f24b4b2c94434938e4950663e",
    "d0d91219aa769da6bb1201b0934fe64e",
]
GOLDEN_TENANT_A = "92621d218d5e602a3942926854a88897"


def reference_chain(ns: Namespace, tokens: list[int]) -> list[bytes]:
    """The definition, written the slow, obvious way."""
    out, prev = [], ROOT
    step = ns.spec.chunk_tokens
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        body = b"".join(struct.pack("<i", t) for t in chunk)
        prev = xxhash.xxh3_128_digest(prev + ns.seed + struct.pack("<I", len(chunk)) + body)
        out.append(prev)
    return out


def test_golden_vectors() -> None:
    assert NS.seed.hex() == GOLDEN_SEED
    assert [k.hex() for k in chunk_keys(NS, list(range(40)))] == GOLDEN_0_40
    tenant = Namespace("tiny-llama", SPEC, tenant_salt="tenant-a")
    assert chunk_keys(tenant, list(range(16)))[0].hex() == GOLDEN_TENANT_A


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=100))
def test_matches_reference_definition(tokens: list[int]) -> None:
    assert chunk_keys(NS, tokens) == reference_chain(NS, tokens)


def test_stable_across_processes_and_hash_seeds() -> None:
    code = (
        "from kvfabric.spec import KVSpec, Namespace; from kvfabric.hashing import chunk_keys;"
        "ns = Namespace('tiny-llama', KVSpec(4, 2, 64, 'bfloat16', chunk_tokens=16));"
        "print(','.join(k.hex() for k in chunk_keys(ns, list(range(40)))))"
    )
    for seed in ("0", "4242"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        assert out.strip().split(",") == GOLDEN_0_40


def test_chain_structure_and_partial_last_chunk() -> None:
    refs = chunk_hashes(NS, list(range(40)))
    assert [r.num_tokens for r in refs] == [16, 16, 8]
    assert refs[0].parent == ROOT and refs[0].is_root
    assert refs[1].parent == refs[0].key and refs[2].parent == refs[1].key
    assert chunk_keys(NS, list(range(40)), include_partial=False) == [r.key for r in refs[:2]]


def test_partial_chunk_key_differs_from_padded_full_chunk() -> None:
    short = chunk_keys(NS, list(range(8)))
    padded = chunk_keys(NS, list(range(8)) + [0] * 8)
    assert short[0] != padded[0]


def test_prefix_property_and_resume_from_parent() -> None:
    tokens = list(range(100))
    whole = chunk_keys(NS, tokens)
    assert chunk_keys(NS, tokens[:48]) == whole[:3]
    resumed = chunk_keys(NS, tokens[48:], parent=whole[2])
    assert resumed == whole[3:]


def test_one_token_change_changes_that_chunk_and_all_after() -> None:
    tokens = list(range(64))
    changed = tokens.copy()
    changed[20] += 1
    a, b = chunk_keys(NS, tokens), chunk_keys(NS, changed)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))


def test_array_and_list_inputs_agree() -> None:
    tokens = np.arange(1000, dtype=np.int64) * 7
    assert (
        chunk_keys(NS, tokens)
        == chunk_keys(NS, tokens.tolist())
        == chunk_keys(NS, tokens.astype("<i4"))
    )


def test_big_prompt_is_one_call() -> None:
    tokens = np.random.default_rng(0).integers(0, 32000, 128 * 1024, dtype=np.int32)
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, chunk_tokens=256)
    assert len(chunk_keys(Namespace("m", spec), tokens)) == 512


def test_bad_tokens_are_rejected() -> None:
    with pytest.raises(SpecError, match="int32"):
        chunk_keys(NS, [2**40])
    with pytest.raises(SpecError, match="1-D"):
        as_token_array(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(SpecError, match="integers"):
        as_token_array(np.zeros(3, dtype=np.float32))
    with pytest.raises(SpecError, match="parent"):
        chunk_keys(NS, [1, 2], parent=b"short")


@pytest.fixture(params=["compiled", "numpy"])
def list_path(request, monkeypatch):
    """Python lists go through the compiled packer where it was built, else numpy: both
    paths must give the same keys and refuse the same inputs."""
    if request.param == "compiled":
        if hashing.pack_int32 is None:
            pytest.skip("the install built no kvfabric._tokens (no C compiler)")
    else:
        monkeypatch.setattr(hashing, "pack_int32", None)
    return request.param


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=80))
@settings(max_examples=60, deadline=None)
def test_a_list_a_tuple_and_an_int32_array_hash_alike(values: list[int]) -> None:
    array = np.array(values, dtype=np.int32)
    expected = chunk_keys(NS, array)
    assert chunk_keys(NS, values) == expected
    assert chunk_keys(NS, tuple(values)) == expected
    assert hashing.token_bytes(values) == array.astype("<i4").tobytes()


def test_both_list_paths_give_the_golden_keys(list_path: str) -> None:
    assert [k.hex() for k in chunk_keys(NS, list(range(40)))] == GOLDEN_0_40
    assert chunk_keys(NS, [np.int64(7), np.uint16(9), -(2**31)]) == chunk_keys(
        NS, np.array([7, 9, -(2**31)], dtype=np.int32)
    )
    assert as_token_array([]).size == 0


@pytest.mark.parametrize(
    "bad", [[2**31], [-(2**31) - 1], [2**70], [1.5], ["7"], [None], [True], [1, 2.0]]
)
def test_both_list_paths_refuse_what_is_not_an_int32(list_path: str, bad: list) -> None:
    with pytest.raises(SpecError, match="int32|integer"):
        chunk_keys(NS, bad)
