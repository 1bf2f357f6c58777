"""A consumer's read spec: tensor-parallel head ranges, validation, wire form."""

from __future__ import annotations

import itertools

import pytest

from kvfabric.errors import SpecError
from kvfabric.readspec import Conversion, KVLayout, ReadSpec, tp_head_range, tp_writes
from kvfabric.spec import KVDtype, KVSpec

GQA4 = KVSpec(4, 4, 64, "bfloat16", chunk_tokens=16)
GQA2 = KVSpec(4, 2, 64, "bfloat16", chunk_tokens=16)
MLA = KVSpec(4, 1, 576, "bfloat16", kind="mla", chunk_tokens=16)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_that_divide_the_heads_partition_them(tp: int) -> None:
    ranges = [tp_head_range(GQA4, rank, tp) for rank in range(tp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(tp_writes(GQA4, rank, tp) for rank in range(tp))


def test_more_ranks_than_heads_replicate_each_head_and_only_the_first_replica_writes() -> None:
    assert [tp_head_range(GQA2, r, 8) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [tp_writes(GQA2, r, 8) for r in range(8)] == [True, False, False, False] * 2


def test_a_latent_object_is_replicated_not_sliced() -> None:
    assert {tp_head_range(MLA, r, 4) for r in range(4)} == {(0, 1)}
    assert [tp_writes(MLA, r, 4) for r in range(4)] == [True, False, False, False]


@pytest.mark.parametrize("rank,size", [(0, 3), (2, 2), (-1, 2), (0, 0)])
def test_impossible_tensor_parallel_splits_are_refused(rank: int, size: int) -> None:
    with pytest.raises(SpecError):
        tp_head_range(GQA4, rank, size)


def test_for_rank_names_the_heads_only_when_it_is_a_slice() -> None:
    assert ReadSpec.for_rank(GQA4, 1, 2).heads == (2, 4)
    assert ReadSpec.for_rank(GQA4, 0, 1).heads is None
    assert ReadSpec.for_rank(GQA4, 0, 1).conversions(GQA4) == ()


def test_conversions_name_exactly_what_differs() -> None:
    want = ReadSpec(dtype="fp32", heads=(0, 2), layout="nhd")
    assert want.conversions(GQA4) == (Conversion.DTYPE, Conversion.HEADS, Conversion.LAYOUT)
    assert ReadSpec(dtype="bf16", heads=(0, 4)).conversions(GQA4) == ()
    # one head: token-major and head-major are the same bytes
    assert ReadSpec(layout="nhd").conversions(MLA) == ()


def test_a_spec_the_namespace_cannot_serve_is_refused() -> None:
    with pytest.raises(SpecError, match="outside"):
        ReadSpec(heads=(2, 6)).check(GQA4)
    with pytest.raises(SpecError, match="no conversion"):
        ReadSpec(dtype=KVDtype.FLOAT8_E4M3).check(GQA4)


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"dtype": 3},
        {"dtype": "int8"},
        {"heads": [2, 1]},
        {"heads": [0, True]},
        {"heads": "0:2"},
        {"layout": "khd"},
        {"layout": 1},
        {"color": "red"},
    ],
)
def test_malformed_wire_forms_are_spec_errors(raw: object) -> None:
    with pytest.raises(SpecError):
        ReadSpec.from_wire(raw)


def test_the_wire_form_round_trips() -> None:
    for want in (ReadSpec(), ReadSpec("float32", (1, 3), KVLayout.NHD), ReadSpec(heads=(0, 1))):
        assert ReadSpec.from_wire(want.to_wire()) == want
