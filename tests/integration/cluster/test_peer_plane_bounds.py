"""The peer transport plane of real daemons under a flood: 600 connections that never
handshake cost no thread, a member's pull still works, and the accept loop outlives running
out of file descriptors (EMFILE) with /readyz still 200."""

from __future__ import annotations

import os
import resource
import socket
import time
from pathlib import Path

import httpx
from cluster_nodes import cluster_node, put_random_chain
from daemon_ports import transport_port

from kvfabric.client import Client
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("flood-model", SPEC, tenant_salt="t1")
DEADLINE_S = 5.0


def settings(redis_url: str, node_id: str, secret: Path, *extra: str) -> list[str]:
    peer_plane = (f"cluster.secret_file={secret}", "limits.peer_handshake_timeout_s=2")
    return cluster_node(
        redis_url, node_id, *peer_plane, *extra, transport="socket", lease_ttl_s=None
    )


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def flood(port: int, n: int) -> list[socket.socket]:
    """``n`` connections from 20 loopback addresses that never answer the greeting."""
    out = []
    for i in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((f"127.0.0.{2 + i % 20}", 0))
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        out.append(sock)
    return out


def put_chain(socket_path: str, n_chunks: int) -> tuple[list[bytes], list[bytes]]:
    return put_random_chain(socket_path, NS, n_chunks, seed=11)


def pull(puller, keys: list[bytes], payloads: list[bytes]) -> None:
    deadline = time.monotonic() + 10
    with Client(puller.socket) as client:
        while True:  # until the index shows the owner's chain
            result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
            if result["pulled"] + result["already_local"] == len(keys):
                break
            assert time.monotonic() < deadline, result
            time.sleep(0.1)
        for key, data in zip(keys, payloads):
            with client.get(NS, key) as reader:
                assert reader.to_bytes() == data


def test_600_silent_connections_cost_no_thread_and_a_pull_still_works(
    redis_server, start_daemon, tmp_path: Path
) -> None:
    """Regression: on the old code each connection to the peer port got a thread before its
    handshake (600 connections: 600 threads, held for io_timeout), and once threads ran out
    the accept loop ended for good while /readyz stayed 200."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    owner = start_daemon(*settings(redis_server.url, "node-a", secret))
    member = start_daemon(*settings(redis_server.url, "node-b", secret))
    keys, payloads = put_chain(owner.socket, 4)
    port = transport_port(owner)
    before = threads_of(owner.proc.pid)
    strangers = flood(port, 600)
    try:
        assert len(strangers) == 600
        time.sleep(0.5)
        assert threads_of(owner.proc.pid) <= before + 4
        pull(member, keys, payloads)  # during the flood
        assert threads_of(owner.proc.pid) <= before + 8  # + the member's connection
        assert httpx.get(f"{owner.http_url}/readyz", timeout=5).status_code == 200
    finally:
        for sock in strangers:
            sock.close()


def test_the_accept_loop_outlives_running_out_of_file_descriptors(
    redis_server, start_daemon, tmp_path: Path
) -> None:
    """Regression: on the old code the first accept() error (EMFILE here) ended the accept
    thread for good: no peer could pull from the node again, and /readyz still said 200."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    owner = start_daemon(*settings(redis_server.url, "node-a", secret))
    member = start_daemon(*settings(redis_server.url, "node-b", secret))
    keys, payloads = put_chain(owner.socket, 2)
    port = transport_port(owner)
    pid = owner.proc.pid
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 20, limits[1]))
    strangers = flood(port, 200)  # the kernel completes them; accept() runs out of fds
    try:
        time.sleep(1.0)
        assert "accept failed" in owner.read_log()  # it did hit EMFILE, and said so
    finally:
        for sock in strangers:
            sock.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    time.sleep(2.5)  # handshake deadlines give the descriptors back
    pull(member, keys, payloads)
    assert httpx.get(f"{owner.http_url}/readyz", timeout=5).status_code == 200
