"""The consumer's read spec travels in the get request: a real daemon checks it before it pins,
counts the conversions it implies, and the consumer reads exactly what it asked for (a view
of the shared pages when nothing differs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.client import Client
from kvfabric.convert.request import read_as, read_layer_as, wanted_shape
from kvfabric.errors import SpecError
from kvfabric.hashing import chunk_hashes
from kvfabric.readspec import ReadSpec
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=3, num_kv_heads=4, head_dim=16, dtype="bfloat16", chunk_tokens=32)
NS = Namespace("readspec-model", SPEC)


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("readspec", "store.tiers.dram.capacity=16MiB")


@pytest.fixture(scope="module")
def stored(daemon) -> tuple[list, torch.Tensor]:
    refs = chunk_hashes(NS, list(range(2 * SPEC.chunk_tokens)))
    kv = torch.randn(
        len(refs),
        SPEC.num_layers,
        2,
        4,
        SPEC.chunk_tokens,
        16,
        generator=torch.Generator().manual_seed(7),
    ).to(torch.bfloat16)
    with Client(daemon.socket) as client:
        client.put_many(
            NS, refs, [chunk.contiguous().view(torch.uint8).numpy().reshape(-1) for chunk in kv]
        )
    return refs, kv


def conversions_counted(daemon) -> dict[tuple[str, str], float]:
    import urllib.request

    text = urllib.request.urlopen(daemon.http_url + "/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvfabric_read_conversions":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[(sample.labels["engine"], sample.labels["conversion"])] = sample.value
    return out


def test_a_read_that_changes_nothing_is_a_view_of_the_pinned_pages(daemon, stored) -> None:
    refs, kv = stored
    with (
        Client(daemon.socket) as client,
        client.get(NS, refs[0].key, want=ReadSpec(dtype="bf16")) as reader,
    ):
        layer = read_layer_as(reader, 1)
        assert torch.equal(layer, kv[0, 1])
        pages = reader.layer_pieces(1)[0]
        assert layer.data_ptr() == pages.__array_interface__["data"][0]


def test_a_tensor_parallel_fp32_token_major_read_is_exact(daemon, stored) -> None:
    refs, kv = stored
    want = ReadSpec.for_rank(SPEC, 1, 2, dtype="float32", layout="nhd")
    with Client(daemon.socket, engine="decode-test") as client:
        readers = client.get_many(NS, [r.key for r in refs], want=want)
        try:
            for chunk, reader in zip(kv, readers):
                expected = chunk[:, :, 2:4].transpose(2, 3).float()
                assert torch.equal(read_as(reader), expected)
                out = torch.empty(wanted_shape(reader), dtype=torch.float32)
                assert read_layer_as(reader, 2, out=out) is out
                assert torch.equal(out, expected[2])
        finally:
            client.release_many(readers)
    counted = conversions_counted(daemon)
    for kind in ("dtype", "heads", "layout"):
        assert counted[("decode-test", kind)] >= len(refs)


def test_a_spec_the_namespace_cannot_serve_is_refused_before_anything_is_pinned(
    daemon, stored
) -> None:
    refs, kv = stored
    with Client(daemon.socket) as client:
        with pytest.raises(SpecError, match="outside"):
            client.get(NS, refs[0].key, want=ReadSpec(heads=(3, 8)))
        # the same through the raw protocol: the daemon checks it too, and stays up
        from kvfabric.protocol.messages import Op, encode_namespace

        for want in (
            {"heads": [3, 8]},
            {"dtype": "int4"},
            {"layout": "sideways"},
            [1, 2],
            {"heads": [0, 1], "extra": 1},
        ):
            with pytest.raises(SpecError):
                client._call(Op.GET, {"ns": encode_namespace(NS), "key": refs[0].key, "want": want})
        with client.get(NS, refs[0].key) as reader:  # data intact
            assert np.array_equal(
                reader.to_bytes(), kv[0].contiguous().view(torch.uint8).numpy().tobytes()
            )
