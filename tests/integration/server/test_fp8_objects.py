"""A namespace stored in fp8 through a real daemon: clients put bf16 / fp32 KV into a
``float8_e4m3fn`` namespace (quantized by ``write_layer`` on the client side, one writer or one
per tensor-parallel head range), and other clients get it back converted to their own dtype,
whole or by head range, within kvfabric.convert.fp8's error bound; the daemon holds and moves
the fp8 bytes (scales included), about half of bf16's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvfabric.client import Client
from kvfabric.convert import fp8
from kvfabric.convert.dtype import read_layer, read_payload, write_layer
from kvfabric.convert.request import read_as
from kvfabric.hashing import chunk_hashes
from kvfabric.readspec import ReadSpec
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float8_e4m3", chunk_tokens=32)
NS = Namespace("fp8-daemon", SPEC)
SMALL = [
    "store.tiers.dram.capacity=8MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
    "store.tiers.ssd.format=fp8",
]


def kv(seed: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.rand(4, 2, 4, 1, 1, generator=gen) * 10
    return (torch.randn(4, 2, 4, tokens, 32, generator=gen) * magnitude).to(dtype)


def within_bound(got: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every layer of ``got`` within the documented bound of the original ``x``."""
    return all(
        bool(
            (
                (got[i].double() - x[i].double()).abs()
                <= fp8.error_bound(x[i], fp8.compute_scales(x[i]), dtype)
            ).all()
        )
        for i in range(x.shape[0])
    )


@pytest.fixture
def daemon(start_daemon):
    return start_daemon(*SMALL)


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_put_quantized_get_converted(daemon, source: torch.dtype) -> None:
    refs = chunk_hashes(NS, list(range(3 * 32 - 11)))  # the last chunk partial
    data = [kv(i, ref.num_tokens, source) for i, ref in enumerate(refs)]
    with Client(daemon.socket) as producer:
        for ref, chunk in zip(refs, data):
            with producer.reserve(
                NS, ref.key, parent=ref.parent, num_tokens=ref.num_tokens
            ) as writer:
                assert writer.nbytes == SPEC.layout(ref.num_tokens).nbytes
                for layer in range(4):
                    write_layer(writer, layer, chunk[layer])
                    writer.commit_layer(layer)
    with Client(daemon.socket) as consumer:
        assert consumer.lookup(NS, keys=[r.key for r in refs]).matched_chunks == 3
        for ref, chunk in zip(refs, data):
            with consumer.get(NS, ref.key) as reader:
                for dtype in (torch.bfloat16, torch.float32):
                    got = read_payload(reader, dtype=dtype)
                    assert got.dtype == dtype
                    assert within_bound(got, chunk, dtype)
                    assert torch.equal(
                        got,
                        torch.stack([fp8.dequantize(*fp8.quantize(x), dtype=dtype) for x in chunk]),
                    )
                part = read_layer(reader, 1, heads=(2, 4), dtype=torch.float32)
                assert torch.equal(part, read_payload(reader, dtype=torch.float32)[1, :, 2:4])
            # the consumer's dtype and heads in the get request: the daemon accepts them
            want = ReadSpec(dtype="float16", heads=(0, 2))
            with consumer.get(NS, ref.key, want=want) as reader:
                got = read_as(reader)
                assert got.dtype == torch.float16 and got.shape[2] == 2
                assert within_bound(got, chunk[:, :, 0:2], torch.float16)
        bf16 = dataclasses.replace(SPEC, dtype="bfloat16")
        assert SPEC.chunk_bytes / bf16.chunk_bytes < 0.51


def test_tensor_parallel_ranks_put_their_heads_a_consumer_reads_another_split(daemon) -> None:
    """Two producer ranks (heads [0, 2) and [2, 4), each its own client) quantize and put
    their halves; a consumer with four ranks reads one head each; all of it byte-identical
    to a single writer's object in another namespace."""
    ref = chunk_hashes(NS, list(range(32)))[0]
    single = Namespace("fp8-daemon-single", SPEC)
    one = chunk_hashes(single, list(range(32)))[0]
    data = kv(7, 32, torch.bfloat16)
    with Client(daemon.socket) as rank0, Client(daemon.socket) as rank1:
        writers = [
            rank0.reserve(NS, ref.key, parent=ref.parent, heads=(0, 2)),
            rank1.reserve(NS, ref.key, parent=ref.parent, heads=(2, 4)),
        ]
        for layer in range(4):
            for writer, (a, b) in zip(writers, [(0, 2), (2, 4)]):
                write_layer(writer, layer, data[layer, :, a:b])
                writer.commit_layer(layer)
        with rank0.reserve(single, one.key, parent=one.parent) as writer:
            for layer in range(4):
                write_layer(writer, layer, data[layer])
            writer.commit()
    with Client(daemon.socket) as consumer:
        with consumer.get(NS, ref.key) as split, consumer.get(single, one.key) as whole:
            assert split.to_bytes() == whole.to_bytes()
            full = read_payload(whole, dtype=torch.bfloat16)
            for head in range(4):
                got = read_payload(split, heads=(head, head + 1), dtype=torch.bfloat16)
                assert torch.equal(got, full[:, :, head : head + 1])
                pieces = split.layer_pieces(0, (head, head + 1))
                raw = np.concatenate([np.asarray(p) for p in pieces])
                assert raw.nbytes == 2 * (4 + 32 * 32)  # its values and scales only
    assert within_bound(full, data, torch.bfloat16)
