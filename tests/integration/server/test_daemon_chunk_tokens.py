"""A real daemon process keeps the token ids clients give with their chunks (``tokens`` in
``reserve`` / ``reserve_batch`` items), refuses ids that are not the chunk's own, and still
has them after a restart over its SSD directory."""

from __future__ import annotations

import numpy as np
import pytest
from cluster_nodes import tokens_held

from kvfabric.client import Client
from kvfabric.errors import ProtocolError
from kvfabric.hashing import ChunkRef, chunk_hashes
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("tokens-model", SPEC, tenant_salt="t1")
SETTINGS = [
    "store.tiers.dram.capacity=4MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=32MiB",
    "tcp.port=0",  # tokens_held reads them as a peer would (peer_pin)
]
PROMPT = np.arange(500, 500 + 4 * SPEC.chunk_tokens + 3, dtype="<i4")  # a partial last one


def chunks() -> list[tuple[ChunkRef, bytes]]:
    step = SPEC.chunk_tokens
    return [
        (ref, PROMPT[i * step : i * step + ref.num_tokens].tobytes())
        for i, ref in enumerate(chunk_hashes(NS, PROMPT))
    ]


def zeros(ref: ChunkRef) -> np.ndarray:
    return np.zeros(SPEC.layout(ref.num_tokens).nbytes, np.uint8)


def one_id_changed(tokens: bytes) -> bytes:
    return tokens[:4] + (77777).to_bytes(4, "little") + tokens[8:]


def test_tokens_given_with_chunks_are_kept_by_every_write_call(start_daemon) -> None:
    daemon = start_daemon(*SETTINGS)
    (a, a_tokens), (b, b_tokens), (c, _), (d, d_tokens), (e, _) = chunks()
    with Client(daemon.socket) as client:
        assert client.put(NS, a.key, zeros(a), tokens=a_tokens)
        with client.reserve(NS, b.key, parent=b.parent, tokens=np.frombuffer(b_tokens, "<i4")):
            pass  # left without a commit: aborted, nothing kept
        assert client.put_many(NS, [b, c], [zeros(b), zeros(c)], tokens=[b_tokens, None])
        (writer,) = client.reserve_many(NS, [d], tokens=[np.frombuffer(d_tokens, "<i4").tolist()])
        assert not isinstance(writer, Exception)
        writer.write(zeros(d))
        client.commit_many([writer])
        assert client.put(NS, e.key, zeros(e), parent=e.parent, num_tokens=3)  # without
    held = tokens_held(daemon.info["tcp_port"], NS, [a.key, b.key, c.key, d.key, e.key])
    assert held == [a_tokens, b_tokens, None, d_tokens, None]


def test_tokens_that_are_not_the_chunks_own_are_a_bad_request(start_daemon) -> None:
    daemon = start_daemon(*SETTINGS)
    (a, a_tokens), (b, b_tokens), (c, c_tokens) = chunks()[:3]
    with Client(daemon.socket) as client:
        with pytest.raises(ProtocolError, match="do not hash"):
            client.reserve(NS, a.key, tokens=one_id_changed(a_tokens))
        with pytest.raises(ProtocolError, match="16 int32-LE ids"):
            client.put(NS, a.key, zeros(a), tokens=a_tokens[:-4])
        with pytest.raises(ProtocolError, match="int32-LE"):  # not whole ids: the arg check
            client.reserve(NS, a.key, tokens=a_tokens[:-1])
        # in a batch only the bad item fails; the good one is stored (negative control)
        results = client.reserve_many(NS, [b, c], tokens=[b_tokens, one_id_changed(c_tokens)])
        assert isinstance(results[1], ProtocolError) and results[1].kind == "bad_request"
        writer = results[0]
        assert not isinstance(writer, Exception)
        writer.write(zeros(b))
        client.commit_many([writer])
        assert client.contains(NS, [a.key, b.key, c.key]) == [False, True, False]
        assert client.stats()["objects"] == 1  # nothing reserved for the refused ones
    assert tokens_held(daemon.info["tcp_port"], NS, [b.key]) == [b_tokens]


def test_a_restarted_daemon_still_has_the_tokens(start_daemon, tmp_path) -> None:
    data_dir = tmp_path / "node"
    daemon = start_daemon(*SETTINGS, data_dir=data_dir)
    (a, a_tokens), (b, _) = chunks()[:2]
    with Client(daemon.socket) as client:
        assert client.put(NS, a.key, zeros(a), tokens=a_tokens)
        assert client.put(NS, b.key, zeros(b), parent=b.parent)  # without
    assert daemon.stop() == 0  # persists memory-resident chunks to SSD
    daemon = start_daemon(*SETTINGS, data_dir=data_dir)
    with Client(daemon.socket) as client:
        assert client.lookup(NS, keys=[a.key, b.key]).tier_tokens == {"ssd": 2 * SPEC.chunk_tokens}
    assert tokens_held(daemon.info["tcp_port"], NS, [a.key, b.key]) == [a_tokens, None]
