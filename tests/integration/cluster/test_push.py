"""Push: a prefill node's daemon pushes chunks to the decode node a router chose, layer by
layer as the layers are committed (separate processes on one real redis-server, over the
socket and NIXL transports); the target's readers wait on layers still in flight, and a
target that dies costs the pusher only its deadline."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
from cluster_nodes import chain_tokens, cluster_node, put_random_chain, tokens_held
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.client import Client
from kvfabric.client.objects import RemoteReader
from kvfabric.errors import KVFabricError, NotFoundError
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("push-model", SPEC, tenant_salt="t1")
TRANSPORTS = ["socket", "nixl"]  # both always: tests/run.sh installs NIXL
DEADLINE_S = 5.0
# more layers than NS, so that streaming has several steps to order
STREAM_SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
STREAM_NS = Namespace("push-stream-model", STREAM_SPEC, tenant_salt="t1")
LAYER_GAP_S = 0.3  # between the producer's layer commits


def node_settings(redis_url: str, node_id: str, transport: str, *extra: str) -> list[str]:
    return cluster_node(redis_url, node_id, *extra, transport=transport)


def push_chunks_counted(node) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(node.http_url + "/metrics", timeout=10).read().decode()
    return {
        (s.labels["target_class"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvfabric_push_chunks"
        for s in family.samples
        if s.name.endswith("_total")
    }


def push_landed_fraction(node) -> dict[str, float]:
    """``kvfabric_push_landed_fraction``'s count and sum, over its target classes."""
    text = urllib.request.urlopen(node.http_url + "/metrics", timeout=10).read().decode()
    found = {"count": 0.0, "sum": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "kvfabric_push_landed_fraction":
            for sample in family.samples:
                for part in found:
                    if sample.name.endswith("_" + part):
                        found[part] += sample.value
    return found


def chunk_counts(result: dict[str, Any]) -> dict[str, Any]:
    """A push's reply without the bytes it moved (how far a failed push got varies)."""
    return {k: v for k, v in result.items() if k not in ("wire_bytes", "native_bytes")}


def put_chain(socket: str, n_chunks: int) -> tuple[list[bytes], list[bytes]]:
    """A chain of random chunks; returns (keys, payloads)."""
    return put_random_chain(socket, NS, n_chunks)


def dram_used(client: Client) -> int:
    return next(t["used_bytes"] for t in client.stats()["tiers"] if t["name"] == "dram")


def get_when_there(client: Client, ns: Namespace, key: bytes) -> RemoteReader:
    """Pin ``key`` on the client's node once a push has reserved it there."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return client.get(ns, key)
        except NotFoundError:
            assert time.monotonic() < deadline, "the push never reserved the chunk"
            time.sleep(0.01)


def layer_payloads(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    layer_bytes = STREAM_SPEC.layout().layer_range(0)[1]
    return [
        rng.integers(0, 256, layer_bytes, dtype=np.uint8).tobytes()
        for _ in range(STREAM_SPEC.num_layers)
    ]


def push_in_thread(
    socket: str, ns: Namespace, keys: list[bytes], target: str, results: list[dict[str, Any]]
) -> threading.Thread:
    def run() -> None:
        with Client(socket) as client:
            results.append(client.push(ns, keys, target, timeout=DEADLINE_S))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_copies_a_committed_chain_byte_exact_and_releases_the_pins(
    redis_server, start_daemon, transport: str
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport))
    # other page size on the target: local and remote page ranges must be sliced apart
    b = start_daemon(
        *node_settings(
            redis_server.url,
            "node-b",
            transport,
            "store.tiers.dram.page_size=4KiB",
            "cluster.hardware_class=decode-cpu",
        )
    )
    keys, payloads = put_chain(a.socket, 3)
    with Client(a.socket) as producer:
        result = producer.push(NS, keys, "node-b", timeout=DEADLINE_S)
        # complete before the push began: every layer in one transfer, all of it a tail
        tail_ms = result.pop("tail_ms")
        assert 0 < tail_ms < DEADLINE_S * 1000
        assert result == {
            "pushed": 3,
            "already_there": 0,
            "failed": 0,
            "target_class": "decode-cpu",
            "landed_fraction": 0.0,
            "layers_moved": SPEC.num_layers,
            "batches": 1,
            "wire_bytes": 3 * SPEC.chunk_bytes,  # native: this node names no fp8 target
            "native_bytes": 3 * SPEC.chunk_bytes,
        }
        with Client(b.socket) as decode:
            hit = decode.lookup(NS, keys=keys)
            assert (hit.matched_chunks, hit.tier_tokens) == (3, {"dram": 3 * SPEC.chunk_tokens})
            for key, data in zip(keys, payloads):
                with decode.get(NS, key) as reader:  # from B's own arena
                    assert reader.complete
                    assert reader.to_bytes() == data
        # B's copies keep each chunk's token ids (what B's KV events report)
        assert tokens_held(b.info["tcp_port"], NS, keys) == chain_tokens(NS, 3)
        assert producer.push(NS, keys, "node-b", timeout=DEADLINE_S) == {
            "pushed": 0,
            "already_there": 3,
            "failed": 0,
            "target_class": "decode-cpu",
            "wire_bytes": 0,
            "native_bytes": 0,
        }
        assert push_chunks_counted(a) == {
            ("decode-cpu", "pushed"): 3,
            ("decode-cpu", "already_there"): 3,
        }
        # a pin left behind would keep its pages taken after the delete
        for key in keys:
            assert producer.delete(NS, key)
        assert dram_used(producer) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_target_reads_layer_0_while_later_layers_are_not_computed_yet(
    redis_server, start_daemon, transport: str
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport))
    b = start_daemon(*node_settings(redis_server.url, "node-b", transport))
    key = b"\x07" * 16
    layers = layer_payloads(11)
    committed: list[float] = []  # when each layer was committed on A
    results: list[dict[str, Any]] = []
    with Client(a.socket) as producer, Client(b.socket) as decode:
        writer = producer.reserve(STREAM_NS, key)
        # started before any layer exists: it must wait for them on A
        pusher = push_in_thread(a.socket, STREAM_NS, [key], "node-b", results)
        with get_when_there(decode, STREAM_NS, key) as reader:
            assert reader.ready_mask == 0  # reserved on B, nothing committed yet
            for layer, data in enumerate(layers):
                time.sleep(LAYER_GAP_S)
                writer.write_layer(layer, data)
                writer.commit_layer(layer)
                committed.append(time.monotonic())
                if layer == 0:
                    reader.wait_layer(0, DEADLINE_S)
                    arrived = time.monotonic()
                    assert not reader.complete
            pusher.join(DEADLINE_S + 5)
            (result,) = results
            tail_ms = result.pop("tail_ms")
            assert result == {
                "pushed": 1,
                "already_there": 0,
                "failed": 0,
                "target_class": "generic",
                # one layer per transfer, each landed before the next was committed: all but
                # the last were on B when A committed the last one
                "landed_fraction": 0.75,
                "layers_moved": 4,
                "batches": 4,
                "wire_bytes": STREAM_SPEC.chunk_bytes,
                "native_bytes": STREAM_SPEC.chunk_bytes,
            }
            assert 0 < tail_ms < LAYER_GAP_S * 1000
            reader.wait_complete(DEADLINE_S)
            assert committed[0] <= arrived < committed[1]  # streamed, not sent at the end
            assert reader.to_bytes() == b"".join(layers)
    # the node's metrics saw the same push
    histogram = push_landed_fraction(a)
    assert (histogram["count"], histogram["sum"]) == (1.0, 0.75)


def test_a_target_killed_mid_push_costs_only_the_deadline(redis_server, start_daemon) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a", "socket"))
    b = start_daemon(*node_settings(redis_server.url, "node-b", "socket"))
    key = b"\x09" * 16
    layers = layer_payloads(13)
    results: list[dict[str, Any]] = []
    with Client(a.socket) as producer:
        baseline = dram_used(producer)
        writer = producer.reserve(STREAM_NS, key)
        started = time.monotonic()
        pusher = push_in_thread(a.socket, STREAM_NS, [key], "node-b", results)
        with Client(b.socket) as decode:
            reader = get_when_there(decode, STREAM_NS, key)
            writer.write_layer(0, layers[0])
            writer.commit_layer(0)
            reader.wait_layer(0, DEADLINE_S)  # the push is under way
        b.kill()
        for layer in range(1, STREAM_SPEC.num_layers):
            writer.write_layer(layer, layers[layer])
            writer.commit_layer(layer)
        pusher.join(DEADLINE_S + 5)
        assert time.monotonic() - started < DEADLINE_S + 1
        assert [chunk_counts(r) for r in results] == [
            {"pushed": 0, "already_there": 0, "failed": 1, "target_class": "generic"}
        ]
        # A serves on, and the push's pin is gone: deleting the chunk frees its pages
        with producer.get(STREAM_NS, key) as local:
            assert local.to_bytes() == b"".join(layers)
        assert producer.delete(STREAM_NS, key)
        assert dram_used(producer) == baseline


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("when", ["before", "mid"])
def test_a_frozen_target_costs_the_pusher_only_the_deadline_and_its_pins(
    redis_server, start_daemon, transport: str, when: str
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport))
    b = start_daemon(*node_settings(redis_server.url, "node-b", transport))
    assert b.proc is not None
    key = b"\x0b" * 16
    layers = layer_payloads(17)
    results: list[dict[str, Any]] = []
    with Client(b.socket) as decode:
        target_baseline = dram_used(decode)
    with Client(a.socket) as producer:
        baseline = dram_used(producer)
        writer = producer.reserve(STREAM_NS, key)
        if when == "before":
            for layer, data in enumerate(layers):
                writer.write_layer(layer, data)
                writer.commit_layer(layer)
            b.proc.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            pusher = push_in_thread(a.socket, STREAM_NS, [key], "node-b", results)
        else:
            started = time.monotonic()
            pusher = push_in_thread(a.socket, STREAM_NS, [key], "node-b", results)
            with Client(b.socket) as decode, get_when_there(decode, STREAM_NS, key) as reader:
                writer.write_layer(0, layers[0])
                writer.commit_layer(0)
                reader.wait_layer(0, DEADLINE_S)  # the push is under way
            b.proc.send_signal(signal.SIGSTOP)
            for layer in range(1, STREAM_SPEC.num_layers):  # these go to a frozen target
                writer.write_layer(layer, layers[layer])
                writer.commit_layer(layer)
        try:
            pusher.join(DEADLINE_S + 5)
            # the deadline, plus the short grace an abort of the target's reservations gets
            assert time.monotonic() - started < DEADLINE_S + 2
            assert [chunk_counts(r) for r in results] == [
                {"pushed": 0, "already_there": 0, "failed": 1, "target_class": "generic"}
            ]
            # the push's pin is gone: deleting the chunk frees its pages
            with producer.get(STREAM_NS, key) as local:
                assert local.to_bytes() == b"".join(layers)
            assert producer.delete(STREAM_NS, key)
            assert dram_used(producer) == baseline
        finally:
            b.proc.send_signal(signal.SIGCONT)
    # Thawed, the target finds the pusher's session gone and drops what it had reserved, or
    # first runs a commit that reached it before the freeze: that one follows a finished
    # write, so the chunk is then whole and byte-exact. Nothing stays half there.
    with Client(b.socket) as decode:
        deadline = time.monotonic() + DEADLINE_S
        while dram_used(decode) != target_baseline:
            try:
                with decode.get(STREAM_NS, key) as copy:
                    if copy.complete:
                        assert copy.to_bytes() == b"".join(layers)
                        break
            except KVFabricError:
                pass  # not there (any more): the reservation is being dropped
            assert time.monotonic() < deadline, "the target kept a partial chunk"
            time.sleep(0.05)
