"""Pull: a node's daemon copies chunks it lacks from the daemons that own them (separate
processes on one real redis-server, over the socket and NIXL transports), then serves them
from its own arena; owners that die or freeze cost only the deadline."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from cluster_nodes import chain_tokens, cluster_node, put_random_chain, tokens_held

from kvfabric.client import Client
from kvfabric.client import requests as client_requests
from kvfabric.config import load_config
from kvfabric.errors import ConfigError
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.messages import Op
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("pull-model", SPEC, tenant_salt="t1")
TRANSPORTS = ["socket", "nixl"]  # both always: tests/run.sh installs NIXL
DEADLINE_S = 5.0


def node_settings(redis_url: str, node_id: str, transport: str, *extra: str) -> list[str]:
    return cluster_node(redis_url, node_id, *extra, transport=transport)


def put_chain(socket: str, n_chunks: int) -> tuple[list[bytes], list[bytes]]:
    """A chain of random chunks; returns (keys, payloads)."""
    return put_random_chain(socket, NS, n_chunks)


def wait_until_held(viewer: Any, keys: list[bytes], node_ids: set[str]) -> None:
    """Until the global index (as ``viewer`` sees it) lists the whole chain on ``node_ids``."""
    deadline = time.monotonic() + 10
    with Client(viewer.socket) as client:
        while True:
            answer = client._call(
                Op.LOOKUP, {**client_requests.lookup_args(NS, None, keys), "scope": "cluster"}
            )
            held = {n["node_id"] for n in answer["nodes"] if n["chunks"] == len(keys)}
            if node_ids <= held:
                return
            assert time.monotonic() < deadline, f"index shows {answer['nodes']}"
            time.sleep(0.05)


def dram_used(client: Client) -> int:
    return next(t["used_bytes"] for t in client.stats()["tiers"] if t["name"] == "dram")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefetch_pulls_a_chain_byte_exact_and_releases_the_owners_pins(
    redis_server, start_daemon, transport: str
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport))
    # other page size on the puller: remote and local page ranges must be sliced apart
    b = start_daemon(
        *node_settings(redis_server.url, "node-b", transport, "store.tiers.dram.page_size=4KiB")
    )
    keys, payloads = put_chain(a.socket, 4)
    wait_until_held(b, keys, {"node-a"})
    with Client(b.socket) as client:
        assert client.lookup(NS, keys=keys).matched_chunks == 0
        result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
        assert result == {"pulled": 4, "already_local": 0, "missing": 0, "source": "node-a"}
        hit = client.lookup(NS, keys=keys)
        assert (hit.matched_chunks, hit.tier_tokens) == (4, {"dram": 4 * SPEC.chunk_tokens})
        for key, data in zip(keys, payloads):
            with client.get(NS, key) as reader:  # zero copy from B's own arena
                assert reader.to_bytes() == data
    # B's copies keep each chunk's token ids (what B's KV events report)
    assert tokens_held(b.info["tcp_port"], NS, keys) == chain_tokens(NS, 4)
    with Client(b.socket) as client:  # by token ids this time: held here now
        assert client.prefetch(NS, tokens=list(range(4 * SPEC.chunk_tokens))) == {
            "pulled": 0,
            "already_local": 4,
            "missing": 0,
            "source": None,
        }
    with Client(a.socket) as owner:
        # a pin left behind would keep its pages taken after the delete
        for key in keys:
            assert owner.delete(NS, key)
        assert dram_used(owner) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("when", ["before", "while"])
def test_an_owner_killed_before_or_during_the_pull_costs_only_the_deadline(
    redis_server, start_daemon, when: str, transport: str
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport))
    b = start_daemon(*node_settings(redis_server.url, "node-b", transport))
    keys, _ = put_chain(a.socket, 4)
    wait_until_held(b, keys, {"node-a"})
    with Client(b.socket) as client:
        baseline = dram_used(client)
        results: list[dict[str, Any]] = []
        started = time.monotonic()
        if when == "before":
            a.kill()
            results.append(client.prefetch(NS, keys=keys, timeout=DEADLINE_S))
        else:
            # frozen first, so the pull is surely waiting on A when A dies
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            with Client(b.socket) as puller:
                pull = threading.Thread(
                    target=lambda: results.append(
                        puller.prefetch(NS, keys=keys, timeout=DEADLINE_S)
                    )
                )
                pull.start()
                time.sleep(0.5)
                a.kill()
                pull.join(DEADLINE_S + 5)
        assert time.monotonic() - started < DEADLINE_S + 1
        assert results == [{"pulled": 0, "already_local": 0, "missing": 4, "source": None}]
        assert dram_used(client) == baseline  # every local reservation was aborted
        assert client.lookup(NS, keys=keys).matched_chunks == 0
        # B still serves
        data = bytes(SPEC.chunk_bytes)
        assert client.put(NS, b"\x01" * 16, data)
        with client.get(NS, b"\x01" * 16) as reader:
            assert reader.to_bytes() == data


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_frozen_first_owner_falls_back_to_the_second_within_the_deadline(
    redis_server, start_daemon, transport: str
) -> None:
    # equal prefixes and tiers: node ids break the tie, so the frozen node-a is tried first
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport))
    c = start_daemon(*node_settings(redis_server.url, "node-c", transport))
    b = start_daemon(*node_settings(redis_server.url, "node-b", transport))
    keys, payloads = put_chain(a.socket, 4)
    put_chain(c.socket, 4)
    wait_until_held(b, keys, {"node-a", "node-c"})
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        with Client(b.socket) as client:
            started = time.monotonic()
            result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
            assert time.monotonic() - started < DEADLINE_S
            assert result == {"pulled": 4, "already_local": 0, "missing": 0, "source": "node-c"}
            for key, data in zip(keys, payloads):
                with client.get(NS, key) as reader:
                    assert reader.to_bytes() == data
    finally:
        a.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_frozen_only_owner_is_a_miss_within_the_deadline_and_keeps_no_pins(
    redis_server, start_daemon, transport: str
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport))
    b = start_daemon(*node_settings(redis_server.url, "node-b", transport))
    keys, payloads = put_chain(a.socket, 4)
    wait_until_held(b, keys, {"node-a"})
    assert a.proc is not None
    with Client(b.socket) as client:
        baseline = dram_used(client)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
            assert time.monotonic() - started < DEADLINE_S + 1
            assert result == {"pulled": 0, "already_local": 0, "missing": 4, "source": None}
            assert dram_used(client) == baseline  # every local reservation was aborted
        finally:
            a.proc.send_signal(signal.SIGCONT)
        # a retry once the owner runs again pulls the chain (a fresh connection)
        assert client.prefetch(NS, keys=keys, timeout=DEADLINE_S)["pulled"] == 4
        for key, data in zip(keys, payloads):
            with client.get(NS, key) as reader:
                assert reader.to_bytes() == data
    with Client(a.socket) as owner:
        # the dropped session gave the frozen pull's pins back: deletes free every page
        for key in keys:
            assert owner.delete(NS, key)
        deadline = time.monotonic() + DEADLINE_S
        while dram_used(owner) != 0:
            assert time.monotonic() < deadline, "the owner kept pages pinned"
            time.sleep(0.05)


def test_a_copy_that_outlived_the_owners_pins_is_discarded(redis_server, start_daemon) -> None:
    # pins that lapse at once: the owner may reuse the pages mid-read, so the copy is torn
    a = start_daemon(
        *node_settings(redis_server.url, "node-a", "socket", "store.pin_timeout_s=0.001")
    )
    b = start_daemon(*node_settings(redis_server.url, "node-b", "socket"))
    keys, _ = put_chain(a.socket, 4)
    wait_until_held(b, keys, {"node-a"})
    with Client(b.socket) as client:
        baseline = dram_used(client)
        result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
        assert result == {"pulled": 0, "already_local": 0, "missing": 4, "source": None}
        assert dram_used(client) == baseline  # the reservations were aborted
        assert client.lookup(NS, keys=keys).matched_chunks == 0


def test_a_redis_node_needs_its_tcp_endpoint_and_a_known_transport(
    redis_server, start_daemon
) -> None:
    with pytest.raises(RuntimeError, match="tcp.port"):
        start_daemon(*node_settings(redis_server.url, "node-a", "socket", "tcp.port=null"))
    with pytest.raises(ConfigError, match="cluster.transport"):
        load_config(env={}, overrides=["cluster.transport=rdma"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_only_nodes_holding_the_cluster_secret_move_chunks(
    redis_server, start_daemon, tmp_path, transport: str
) -> None:
    shared, other = tmp_path / "secret", tmp_path / "other-secret"
    shared.write_bytes(b"s" * 32)
    other.write_bytes(b"o" * 32)
    a = start_daemon(
        *node_settings(redis_server.url, "node-a", transport, f"cluster.secret_file={shared}")
    )
    b = start_daemon(
        *node_settings(redis_server.url, "node-b", transport, f"cluster.secret_file={shared}")
    )
    c = start_daemon(
        *node_settings(redis_server.url, "node-c", transport, f"cluster.secret_file={other}")
    )
    keys, payloads = put_chain(a.socket, 2)
    wait_until_held(c, keys, {"node-a"})
    with Client(c.socket) as stranger:  # a wrong secret: A's descriptor does not verify
        result = stranger.prefetch(NS, keys=keys, timeout=DEADLINE_S)
        assert result["pulled"] == 0 and result["missing"] == 2
        assert stranger.lookup(NS, keys=keys).matched_chunks == 0
    with Client(b.socket) as member:
        assert member.prefetch(NS, keys=keys, timeout=DEADLINE_S)["pulled"] == 2
        with member.get(NS, keys[1]) as reader:
            assert reader.to_bytes() == payloads[1]


def test_a_short_or_missing_cluster_secret_is_a_config_error(tmp_path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"x" * 8)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        load_config(env={}, overrides=[f"cluster.secret_file={short}"]).cluster.secret()
    with pytest.raises(ConfigError, match="secret_file"):
        load_config(env={}, overrides=[f"cluster.secret_file={tmp_path / 'nope'}"]).cluster.secret()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tenants_chunks_are_pulled_from_its_arena_into_its_arena(
    redis_server, start_daemon, transport: str
) -> None:
    """With tenants, a node's arenas are several regions of its transport (a tenant's arena
    ids differ between nodes configured with different tenants): a tenant's chain is read
    from the owner's arena of that tenant into the puller's, and served from there to the
    tenant's own session, which maps no other arena."""
    admin, token = "admin-tok", "t1-tok"
    auth = [f"auth.token={admin}", f"auth.tenants.{token}=t1"]
    a = start_daemon(*node_settings(redis_server.url, "node-a", transport, *auth))
    b = start_daemon(
        *node_settings(redis_server.url, "node-b", transport, *auth, "auth.tenants.t0-tok=t0")
    )  # t1's arena: another id
    refs = chunk_hashes(NS, list(range(3 * SPEC.chunk_tokens)))
    rng = np.random.default_rng(11)
    payloads = [rng.integers(0, 256, SPEC.chunk_bytes, dtype=np.uint8).tobytes() for _ in refs]
    with Client(a.socket, token=token) as owner:
        for ref, data in zip(refs, payloads):
            assert owner.put(NS, ref.key, data, parent=ref.parent)
    keys = [r.key for r in refs]
    deadline = time.monotonic() + 10
    with Client(b.socket, token=token) as client:
        while client.lookup(NS, keys=keys, scope="cluster").cluster_chunks < 3:
            assert time.monotonic() < deadline, "the owner's chunks never reached the index"
            time.sleep(0.05)
        arenas = client._session().hello["arenas"]
        assert [x["arena"] for x in arenas] == [3]  # t1's own arena only (t0's is 2)
        result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
        assert result["pulled"] == 3, result
        for key, data in zip(keys, payloads):
            with client.get(NS, key) as reader:
                assert reader.arena_id == 3 and reader.to_bytes() == data
