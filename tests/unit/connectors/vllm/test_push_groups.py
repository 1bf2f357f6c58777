"""A producer step's pushes: one per (tenant, LoRA, target, layer set), so the requests computed in
one step stream each layer together instead of one request's push waiting for another's."""

from __future__ import annotations

from kvfabric_connectors.vllm.metadata import ChunkSlice, RequestTransfer
from kvfabric_connectors.vllm.worker import _push_groups


def transfer(req: str, tenant: str, target: str | None, *keys: bytes) -> RequestTransfer:
    chunks = tuple(ChunkSlice(key, b"\0" * 16, 0, 256) for key in keys)
    return RequestTransfer(req, tenant, "", (1,), chunks, target)


def test_requests_of_one_step_to_one_target_share_one_push() -> None:
    groups = _push_groups(
        (
            transfer("a", "t", "decode-b", b"a1", b"a2"),
            transfer("b", "t", "decode-b", b"b1"),
            transfer("c", "t", "decode-c", b"c1"),
            transfer("d", "other", "decode-b", b"d1"),
            transfer("e", "t", None, b"e1"),  # saved, not pushed
        )
    )
    assert groups == {
        ("t", "", "decode-b", 0): [b"a1", b"a2", b"b1"],
        ("t", "", "decode-c", 0): [b"c1"],
        ("other", "", "decode-b", 0): [b"d1"],  # another tenant: another namespace
    }


def test_a_step_without_pushes_has_none() -> None:
    assert _push_groups((transfer("a", "t", None, b"a1"),)) == {}
