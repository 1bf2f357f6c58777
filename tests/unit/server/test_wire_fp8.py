"""fp8 on the wire, both ends in one process over a real store: what the sender encodes
into its staging, copied into the target's staging as a transport would, lands decoded
within the error bound; a scale changed on the way is caught by the checksum, the commit
refused and the reservation aborted; staging room comes back when reservations end."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvfabric.config import AuthConfig
from kvfabric.convert import fp8
from kvfabric.errors import NotFoundError, ProtocolError
from kvfabric.hashing import chunk_hashes
from kvfabric.memory.copy import copy_pieces
from kvfabric.protocol.messages import encode_namespace
from kvfabric.server import handlers
from kvfabric.server.handlers import Context
from kvfabric.server.session import Session
from kvfabric.server.wire_fp8 import (
    FP8,
    NATIVE,
    STAGING_PAGE,
    Fp8Targets,
    Fp8Wire,
    Inbound,
    WireStaging,
    encode_layers,
    encoded_nbytes,
    layer_nbytes,
)
from kvfabric.spec import KVSpec, Namespace
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.store.handles import ObjectWriter
from kvfabric.tiers.base import TierKind

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("wire", SPEC)
SHAPE = (SPEC.num_layers, SPEC.kv_planes, SPEC.num_kv_heads, SPEC.chunk_tokens, SPEC.head_dim)
ALL = (1 << SPEC.num_layers) - 1
REFS = chunk_hashes(NS, list(range(4 * SPEC.chunk_tokens)))


@pytest.fixture
def store(tmp_path) -> Iterator[TieredStore]:
    tiers = (TierConfig(TierKind.DRAM, 1 << 20, page_size=4096),)
    s = TieredStore(StoreConfig(data_dir=str(tmp_path), tiers=tiers), maintenance=False)
    yield s
    s.close()


@pytest.fixture
def kv(store: TieredStore) -> torch.Tensor:
    """Chunk 0, stored: values spanning 5 decades across heads."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    x = (x * torch.logspace(-2, 3, SPEC.num_kv_heads).view(1, 1, -1, 1, 1)).to(torch.bfloat16)
    store.put(NS, REFS[0].key, x.view(torch.uint8).reshape(-1), parent=REFS[0].parent)
    return x


def send(store: TieredStore, sender: WireStaging, receiver: Inbound, writer: ObjectWriter) -> int:
    """Encode chunk 0 into the sender's staging and copy it into the target's (the
    transport's part); the checksum the sender would commit with."""
    room = sender.take(encoded_nbytes(SPEC, SPEC.chunk_tokens))
    assert room is not None
    staging = receiver.take(writer)
    assert staging is not None
    target = receiver._landing[id(writer)].staged
    with store.get(NS, REFS[0].key) as reader:
        offset, length, checksum = encode_layers(sender, room, reader, 0, SPEC.num_layers)
    copy_pieces(
        receiver.staging.pieces(target, offset, length), sender.pieces(room, offset, length)
    )
    sender.give(room)
    return checksum


def read(store: TieredStore, key: bytes) -> torch.Tensor:
    with store.get(NS, key) as reader:
        raw = torch.frombuffer(bytearray(reader.to_bytes()), dtype=torch.uint8)
    return raw.view(torch.bfloat16).view(SHAPE)


def test_a_chunk_lands_decoded_within_the_error_bound(store, kv) -> None:
    sender, receiver = WireStaging(1 << 20), Inbound(WireStaging(1 << 20))
    writer = store.reserve(NS, REFS[1].key, parent=REFS[1].parent)
    checksum = send(store, sender, receiver, writer)
    receiver.land(writer, ALL, checksum)
    assert writer.commit_layers(ALL)
    receiver.done(writer)
    landed = read(store, REFS[1].key)
    for layer in range(SPEC.num_layers):
        x = kv[layer]
        bound = fp8.error_bound(x, fp8.compute_scales(x), torch.bfloat16)
        assert bool(((landed[layer].float() - x.float()).abs() <= bound).all())
    assert not torch.equal(landed, kv)  # lossy: it did go through e4m3


def test_a_scale_changed_on_the_way_is_caught(store, kv) -> None:
    sender, receiver = WireStaging(1 << 20), Inbound(WireStaging(1 << 20))
    writer = store.reserve(NS, REFS[1].key, parent=REFS[1].parent)
    checksum = send(store, sender, receiver, writer)
    target = receiver._landing[id(writer)].staged
    scale = receiver.staging.pieces(target, 0, 4)[0]  # layer 0, K, head 0: its float32 scale
    scale[:] = np.frombuffer(np.float32(np.frombuffer(scale, "<f4")[0] * 2).tobytes(), np.uint8)
    with pytest.raises(ProtocolError, match="checksum"):
        receiver.land(writer, ALL, checksum)
    with pytest.raises(ProtocolError, match="checksum"):
        receiver.land(writer, ALL, None)  # fp8 layers without a checksum are refused too
    with pytest.raises(ProtocolError, match="consecutive"):
        receiver.land(writer, 0b101, checksum)


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [(0, np.float32(0.0), "scale"), (0, np.float32("inf"), "scale"), (4, np.uint8(0x7F), "NaN")],
)
def test_bytes_the_sender_got_wrong_are_refused_though_their_checksum_matches(
    store, kv, offset: int, value: np.generic, message: str
) -> None:
    sender, receiver = WireStaging(1 << 20), Inbound(WireStaging(1 << 20))
    writer = store.reserve(NS, REFS[1].key, parent=REFS[1].parent)
    send(store, sender, receiver, writer)
    target = receiver._landing[id(writer)].staged
    raw = np.frombuffer(value.tobytes(), np.uint8)
    receiver.staging.pieces(target, offset, raw.size)[0][:] = raw
    checksum = receiver.staging.checksum(target, 0, target.nbytes)  # as the sender sent it
    with pytest.raises(ProtocolError, match=message):
        receiver.land(writer, ALL, checksum)


def test_staging_comes_back_when_reservations_end_however_they_end(store) -> None:
    receiver = Inbound(WireStaging(2 * STAGING_PAGE))  # room for two chunks
    free = receiver.staging._pages.free_pages
    a = store.reserve(NS, REFS[1].key, parent=REFS[1].parent)
    b = store.reserve(NS, REFS[2].key, parent=REFS[2].parent)
    c = store.reserve(NS, REFS[3].key, parent=REFS[3].parent)
    assert receiver.take(a) is not None and receiver.take(b) is not None
    assert receiver.take(c) is None  # full: c travels native
    receiver.done(a)  # committed or aborted through the protocol
    b.abort()  # or its session ended: reclaimed on the next take
    assert receiver.take(c) is not None
    receiver.done(c)
    assert receiver.staging._pages.free_pages == free


def test_only_float_namespaces_travel_as_fp8(store) -> None:
    receiver = Inbound(WireStaging(1 << 20))
    raw = Namespace("bytes", KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, dtype="uint8"))
    ref = chunk_hashes(raw, list(range(raw.spec.chunk_tokens)))[0]
    assert receiver.take(store.reserve(raw, ref.key, parent=ref.parent)) is None


def test_the_targets_configuration_names_nodes_and_hardware_classes() -> None:
    targets = Fp8Targets.parse(" npu-910b, decode-7 ")
    assert targets.wire_for("decode-7", "gpu") == FP8
    assert targets.wire_for("decode-8", "npu-910b") == FP8
    assert targets.wire_for("decode-8", "gpu") == NATIVE
    assert Fp8Targets.parse("*").wire_for("x", "") == FP8
    assert Fp8Targets.parse("").wire_for("x", "y") == NATIVE


def test_a_peer_commit_that_fails_its_checksum_aborts_the_reservation(store, kv) -> None:
    ctx = Context(store, AuthConfig(), "node", 16, fp8=Fp8Wire(WireStaging(1 << 20)))
    session = Session(local=False, max_leases=16)
    session.authenticate(None, "peer")
    item = {"key": REFS[1].key, "parent": REFS[1].parent, "wire": FP8}
    [reply] = handlers.peer_reserve(ctx, session, {"ns": encode_namespace(NS), "items": [item]})
    staging = reply["result"]["staging"]
    assert staging["nbytes"] == SPEC.num_layers * layer_nbytes(SPEC, SPEC.chunk_tokens)
    lease = reply["result"]["lease"]
    [outcome] = handlers.peer_commit(
        ctx, session, {"leases": [lease], "layers": ALL, "checksums": [12345]}
    )
    assert outcome["ok"] is False and outcome["error"]["kind"] == "bad_request"
    with pytest.raises(NotFoundError):  # aborted: never readable
        store.get(NS, REFS[1].key)
    [refused] = handlers.peer_reserve(
        ctx, session, {"ns": encode_namespace(NS), "items": [{**item, "wire": "fp4"}]}
    )
    assert refused["ok"] is False and "wire" in refused["error"]["message"]
