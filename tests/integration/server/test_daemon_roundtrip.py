"""A real daemon process and real clients: the local data path works end to end."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.errors import AlreadyExistsError, ForbiddenError, NotFoundError, ProtocolError
from kvfabric.hashing import chunk_hashes, chunk_keys
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=32)
NS = Namespace("tiny", SPEC, tenant_salt="t1")
SMALL = [
    "store.tiers.dram.capacity=8MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
]


def payload(key: bytes, nbytes: int = SPEC.chunk_bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, nbytes, dtype=np.uint8
    )


def put_prompt(client: Client, n_chunks: int, start: int = 0) -> list[bytes]:
    refs = chunk_hashes(NS, list(range(start, start + n_chunks * SPEC.chunk_tokens)))
    for ref in refs:
        assert client.put(NS, ref.key, payload(ref.key), parent=ref.parent)
    return [r.key for r in refs]


@pytest.fixture
def daemon(start_daemon):
    return start_daemon(*SMALL)


def test_put_get_lookup_round_trip(daemon) -> None:
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 3)
        tokens = list(range(3 * SPEC.chunk_tokens + 7))
        hit = client.lookup(NS, tokens)
        assert (hit.matched_chunks, hit.matched_tokens) == (3, 96)
        assert hit.tier_tokens == {"dram": 96}
        assert client.lookup(NS, keys=[*keys[:2], b"\x00" * 16]).matched_chunks == 2
        for key in keys:
            with client.get(NS, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
        assert client.contains(NS, [*keys, b"\x01" * 16]) == [True, True, True, False]
        assert client.put(NS, keys[0], payload(keys[0])) is False
        with pytest.raises(AlreadyExistsError):
            client.reserve(NS, keys[0])


def test_reads_are_zero_copy_views_of_the_daemons_memory(daemon) -> None:
    with Client(daemon.socket) as writer_client, Client(daemon.socket) as reader_client:
        (key,) = put_prompt(writer_client, 1)
        with reader_client.get(NS, key) as reader:
            pieces = reader.layer_pieces(1)
            first = pieces[0]
            # the same physical bytes, seen through this process's mapping of the arena
            with writer_client.get(NS, key) as other:
                other_first = other.layer_pieces(1)[0]
                assert first.ctypes.data != 0 and np.array_equal(first, other_first)
            arena_views = [a.array for a in reader._session.arenas._arenas.values()]
            assert any(np.shares_memory(first, arena) for arena in arena_views)


def test_layer_streaming_across_processes(daemon) -> None:
    key = chunk_keys(NS, list(range(SPEC.chunk_tokens)))[0]
    data = payload(key).reshape(SPEC.num_layers, -1)
    with Client(daemon.socket) as producer, Client(daemon.socket) as consumer:
        writer = producer.reserve(NS, key)
        reader = consumer.get(NS, key)
        assert not reader.ready(0)
        committed: list[float] = []

        def produce() -> None:
            for layer in range(SPEC.num_layers):
                time.sleep(0.1)
                writer.write_layer(layer, data[layer])
                committed.append(time.monotonic())
                writer.commit_layer(layer)

        thread = threading.Thread(target=produce)
        thread.start()
        reader.wait_layer(3, timeout=20)  # the reader blocks until layer 3 is committed
        assert len(committed) == 4
        for layer in range(SPEC.num_layers):
            assert np.array_equal(np.concatenate(reader.layer_pieces(layer)), data[layer])
        thread.join()
        reader.release()


def test_head_range_read(daemon) -> None:
    with Client(daemon.socket) as client:
        (key,) = put_prompt(client, 1)
        canonical = payload(key).reshape(SPEC.num_layers, 2, SPEC.num_kv_heads, -1)
        with client.get(NS, key) as reader:
            out = np.empty(2 * 2 * SPEC.layout().head_bytes, dtype=np.uint8)
            reader.read_into(out, layer=3, heads=(2, 4))
            assert np.array_equal(out.reshape(2, 2, -1), canonical[3, :, 2:4])
            # or in place: views of the daemon's pages holding just that range
            pieces = reader.layer_pieces(3, heads=(2, 4))
            assert sum(p.nbytes for p in pieces) == out.nbytes
            assert np.array_equal(np.concatenate(pieces).reshape(2, 2, -1), canonical[3, :, 2:4])
            arena_views = [a.array for a in reader._session.arenas._arenas.values()]
            assert all(any(np.shares_memory(p, a) for a in arena_views) for p in pieces)


def test_context_managers_release_and_abort_when_the_body_raises(daemon) -> None:
    with Client(daemon.socket) as client:
        (key,) = put_prompt(client, 1)
        used = client.stats()["tiers"][0]["used_bytes"]
        with pytest.raises(RuntimeError, match="engine failed"):
            with client.get(NS, key) as reader:
                raise RuntimeError("engine failed")
        assert reader.closed
        # a pinned object's pages outlive its delete; these are freed at once: no pin left
        assert client.delete(NS, key)
        assert client.stats()["tiers"][0]["used_bytes"] == used - SPEC.chunk_bytes

        fresh = chunk_keys(NS, list(range(90_000, 90_000 + SPEC.chunk_tokens)))[0]
        with pytest.raises(RuntimeError, match="engine failed"):
            with client.reserve(NS, fresh) as writer:
                writer.write_layer(0, payload(fresh).reshape(SPEC.num_layers, -1)[0])
                writer.commit_layer(0)
                raise RuntimeError("engine failed")
        assert writer.closed
        assert client.contains(NS, [fresh]) == [False]  # aborted, not half-published
        assert client.stats()["tiers"][0]["used_bytes"] == used - SPEC.chunk_bytes


def test_many_clients_at_once(daemon) -> None:
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            with Client(daemon.socket) as client:
                keys = put_prompt(client, 2, start=10_000 * (index + 1))
                for key in keys:
                    with client.get(NS, key) as reader:
                        assert reader.to_bytes() == payload(key).tobytes()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_errors_are_typed_and_the_session_survives(daemon) -> None:
    with Client(daemon.socket) as client:
        with pytest.raises(NotFoundError):
            client.get(NS, b"\x00" * 16)
        with pytest.raises(ProtocolError):
            client._session().call(
                __import__("kvfabric.protocol.messages", fromlist=["Op"]).Op.RELEASE, {"lease": 999}
            )
        client.ping()  # same session, still fine


def test_restart_keeps_ssd_data_and_clients_reconnect(start_daemon, tmp_path) -> None:
    settings = [
        "store.tiers.dram.capacity=256KiB",
        "store.tiers.dram.page_size=16KiB",
        "store.tiers.ssd.capacity=64MiB",
    ]
    daemon = start_daemon(*settings, data_dir=tmp_path / "node")
    client = Client(daemon.socket, reconnect_timeout=60)
    keys = put_prompt(client, 12)  # 12 x 32 KiB: most of it spills to SSD
    on_ssd = [k for k, present in zip(keys, client.contains(NS, keys)) if present]
    assert daemon.stop() == 0
    daemon = start_daemon(*settings, data_dir=tmp_path / "node")
    survived = [k for k, present in zip(keys, client.contains(NS, keys)) if present]
    assert len(survived) >= 6 and set(survived) <= set(on_ssd)
    for key in survived:
        with client.get(NS, key) as reader:
            assert reader.to_bytes() == payload(key).tobytes()
    client.close()


def test_batches_store_and_read_many_chunks_in_two_round_trips(daemon) -> None:
    refs = chunk_hashes(NS, list(range(70_000, 70_000 + 6 * SPEC.chunk_tokens)))
    with Client(daemon.socket) as client:
        assert client.put(NS, refs[2].key, payload(refs[2].key), parent=refs[2].parent)
        stored = client.put_many(NS, refs, [payload(r.key) for r in refs])
        assert stored == [True, True, False, True, True, True]  # the third was there already
        readers = client.get_many(NS, [r.key for r in refs] + [b"\x09" * 16])
        assert readers[-1] is None  # a miss is None, not an error
        for ref, reader in zip(refs, readers):
            assert reader is not None and reader.to_bytes() == payload(ref.key).tobytes()
        client.release_many(readers)
        assert all(r is None or r.closed for r in readers)
        assert client.lookup(NS, keys=[r.key for r in refs]).matched_chunks == 6
        # a failing item does not stop the others
        results = client.reserve_many(NS, refs[:1] + chunk_hashes(NS, [1] * SPEC.chunk_tokens))
        assert isinstance(results[0], AlreadyExistsError)
        client.commit_many(list(results[1:]))
        assert client.contains(NS, [chunk_keys(NS, [1] * SPEC.chunk_tokens)[0]]) == [True]


def test_a_batch_of_chunks_streams_layer_by_layer_one_round_trip_per_layer(daemon) -> None:
    refs = chunk_hashes(NS, list(range(80_000, 80_000 + 3 * SPEC.chunk_tokens)))
    with Client(daemon.socket) as producer, Client(daemon.socket) as consumer:
        writers = producer.reserve_many(NS, refs)
        readers = consumer.get_many(NS, [r.key for r in refs])
        for layer in range(SPEC.num_layers):
            for ref, writer in zip(refs, writers):
                writer.write_layer(layer, payload(ref.key).reshape(SPEC.num_layers, -1)[layer])
            done = producer.commit_layer_many(writers, layer)
            assert done == [layer == SPEC.num_layers - 1] * len(refs)
            for reader in readers:
                reader.wait_layer(layer, timeout=5)  # answered at once: the layer is there
                assert reader.ready(layer) and (
                    layer + 1 == SPEC.num_layers or not reader.ready(layer + 1)
                )
        assert all(w.closed for w in writers)
        assert [r.to_bytes() for r in readers] == [payload(r.key).tobytes() for r in refs]
        consumer.release_many(readers)


def test_streaming_a_forward_pass_longer_than_the_lease_keeps_the_reservation(start_daemon) -> None:
    """Each committed layer renews the lease on both sides (the daemon's deadline and the
    client's own, which stops it touching the pages): a producer whose layers come slower in
    total than ``store.reservation_timeout_s`` still stores the chunks. Before, the client
    gave up at 90% of the first lease (a 4,096-token CPU prefill lost every save)."""
    daemon = start_daemon(
        *SMALL, "store.reservation_timeout_s=1", "store.maintenance_interval_s=0.1"
    )
    refs = chunk_hashes(NS, list(range(90_000, 90_000 + 2 * SPEC.chunk_tokens)))
    with Client(daemon.socket) as producer:
        writers = producer.reserve_many(NS, refs)
        for layer in range(SPEC.num_layers):  # 2.4 s in all, 0.6 s a layer
            time.sleep(0.6)
            for ref, writer in zip(refs, writers):
                writer.write_layer(layer, payload(ref.key).reshape(SPEC.num_layers, -1)[layer])
            producer.commit_layer_many(writers, layer)
        assert all(w.closed for w in writers)
        with producer.get(NS, refs[1].key) as reader:
            assert reader.to_bytes() == payload(refs[1].key).tobytes()


def test_tcp_serves_remote_tooling_but_no_shared_memory(start_daemon) -> None:
    daemon = start_daemon(*SMALL, "tcp.port=0")
    with Client(daemon.socket) as local:
        keys = put_prompt(local, 2)
    with Client(("127.0.0.1", daemon.info["tcp_port"])) as remote:
        assert remote.lookup(NS, keys=keys).matched_chunks == 2
        assert remote.contains(NS, keys) == [True, True]
        assert remote.stats()["objects"] == 2
        with pytest.raises(ForbiddenError, match="local socket"):
            remote.reserve(NS, b"\x05" * 16)
        with pytest.raises(ForbiddenError):
            remote.get(NS, keys[0])


def test_get_copies_into_caller_tensors(daemon) -> None:
    import torch

    with Client(daemon.socket) as client:
        (key,) = put_prompt(client, 1)
        out = torch.empty(SPEC.chunk_bytes // 2, dtype=torch.bfloat16)
        layer = torch.empty(SPEC.layout().layer_bytes // 2, dtype=torch.bfloat16)
        with client.get(NS, key) as reader:
            reader.read_into(out)
            reader.read_into(layer, layer=2)
        assert out.view(torch.uint8).numpy().tobytes() == payload(key).tobytes()
        layer_bytes = SPEC.layout().layer_bytes
        assert (
            layer.view(torch.uint8).numpy().tobytes()
            == payload(key)[2 * layer_bytes : 3 * layer_bytes].tobytes()
        )


def test_keys_travel_packed_only_to_a_daemon_that_announced_it(daemon, monkeypatch) -> None:
    """Additions within the protocol version are announced in hello; a client that meets a
    daemon without "packed_keys" (an older one) sends key lists, and both forms agree."""
    from kvfabric.client import requests
    from kvfabric.protocol.messages import Op

    sent: list[dict] = []
    with Client(daemon.socket) as client:
        keys = put_prompt(client, 2)
        assert {"packed_keys", "read_spec"} <= set(client._session().hello["features"])
        original = client._call

        def spy(op, args, timeout=None):
            if op is Op.LOOKUP:
                sent.append(args)
            return original(op, args, timeout)

        monkeypatch.setattr(client, "_call", spy)
        packed = client.lookup(NS, keys=keys)
        client._session().hello["features"] = []  # as an older daemon answers
        listed = client.lookup(NS, keys=keys)
    assert isinstance(sent[0]["keys"], bytes) and isinstance(sent[1]["keys"], list)
    assert packed.matched_chunks == listed.matched_chunks == 2
    assert requests.packs_keys({}) is False
