"""TLS between real daemons on one real redis-server: with ``security.tls_*`` (default planes
http, tcp and peer) nodes pull and push over mutual TLS, on their TCP control endpoints and
the socket transport alike; a node whose certificate comes from another CA gets nothing;
plain TCP to either TLS port is refused; a certificate reloaded on SIGHUP is what the next
connection sees, and pulls go on. Certificates are made at test time (tests/support)."""

from __future__ import annotations

import signal
import socket
import ssl
import time
from pathlib import Path

import pytest
from cluster_nodes import cluster_node, put_random_chain
from daemon_ports import transport_port
from tls_certs import CA, client_context, serial_of

from kvfabric.client import Client, ClientTLS
from kvfabric.errors import AuthError, UnavailableError
from kvfabric.protocol.frames import encode_frame
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("tls-model", SPEC, tenant_salt="t1")
DEADLINE_S = 5.0


@pytest.fixture
def pki(tmp_path: Path) -> tuple[CA, Path, Path]:
    """(the cluster's CA, its certificate file, the cluster secret file)."""
    authority = CA("kvfabric cluster CA")
    secret = tmp_path / "cluster-secret"
    secret.write_text("s" * 32)
    return authority, authority.write(tmp_path / "cluster-ca.pem"), secret


def node(
    start_daemon, redis_url: str, node_id: str, cert: Path, ca_file: Path, secret: Path, *extra: str
):
    # transport left at auto: with the peer plane on it must be the socket backend
    return start_daemon(
        *cluster_node(
            redis_url,
            node_id,
            f"cluster.secret_file={secret}",
            f"security.tls_cert_file={cert}",
            f"security.tls_client_ca_file={ca_file}",
            *extra,
            lease_ttl_s=None,
        )
    )


def put_chain(daemon, n_chunks: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    return put_random_chain(daemon.socket, NS, n_chunks, seed=seed, first_token=seed * 1000)


def wait_held(viewer, keys: list[bytes], node_id: str) -> None:
    deadline = time.monotonic() + 10
    with Client(viewer.socket) as client:
        while client.lookup(NS, keys=keys, scope="cluster").cluster_chunks < len(keys):
            assert time.monotonic() < deadline, f"{node_id} never listed the chain"
            time.sleep(0.05)


def assert_local(daemon, keys: list[bytes], payloads: list[bytes]) -> None:
    with Client(daemon.socket) as client:
        for key, data in zip(keys, payloads):
            with client.get(NS, key) as reader:
                assert reader.to_bytes() == data


def served(port: int, ca_file: Path, cert: Path) -> int:
    """The serial of the certificate a TLS port serves (we present ``cert``)."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        client_context(ca_file, cert).wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return serial_of(tls.getpeercert(binary_form=True))


def refused_plain(port: int) -> bool:
    """A plain-TCP handshake frame to ``port`` is dropped: no frame back, closed quickly."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as raw:
        raw.sendall(encode_frame({"v": 1, "name": "plain", "nonce": b"n" * 16, "mac": b""}))
        received = b""
        try:
            while data := raw.recv(4096):
                received += data
        except ConnectionError:
            pass
        except TimeoutError:
            return False
    return b"nonce" not in received and b"result" not in received


def test_pull_and_push_between_two_daemons_over_mutual_tls(
    redis_server, start_daemon, tmp_path: Path, pki: tuple[CA, Path, Path]
) -> None:
    """Regression: on the old code TLS on the TCP control plane was refused with the redis
    index and the socket transport had no TLS: chunk bytes crossed in the clear."""
    authority, ca_file, secret = pki
    certs = {name: tmp_path / f"{name}.pem" for name in ("node-a", "node-b", "tool")}
    serials = {name: authority.issue(path, name) for name, path in certs.items()}
    a = node(start_daemon, redis_server.url, "node-a", certs["node-a"], ca_file, secret)
    b = node(start_daemon, redis_server.url, "node-b", certs["node-b"], ca_file, secret)
    assert "peer transport: socket (mutual TLS" in a.read_log()
    keys, payloads = put_chain(a, 4, seed=1)
    wait_held(b, keys, "node-a")
    with Client(b.socket) as client:
        result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
        assert result == {"pulled": 4, "already_local": 0, "missing": 0, "source": "node-a"}
    assert_local(b, keys, payloads)
    pushed, push_payloads = put_chain(b, 3, seed=2)
    with Client(b.socket) as client:
        result = client.push(NS, pushed, "node-a", timeout=DEADLINE_S)
        assert (result["pushed"], result["failed"]) == (3, 0)
    assert_local(a, pushed, push_payloads)
    # both peer-facing ports are TLS with the node's certificate, and mutual
    for port in (a.info["tcp_port"], transport_port(a)):
        assert served(port, ca_file, certs["tool"]) == serials["node-a"]
        assert refused_plain(port)
    with Client(
        ("127.0.0.1", a.info["tcp_port"]),
        tls=ClientTLS(ca_file=str(ca_file), cert_file=str(certs["tool"])),
    ) as remote:
        assert remote.lookup(NS, keys=keys).matched_chunks == 4


def test_a_node_with_a_certificate_from_another_ca_gets_nothing(
    redis_server, start_daemon, tmp_path: Path, pki: tuple[CA, Path, Path]
) -> None:
    """Negative control: node-b holds the cluster secret and trusts the cluster's CA, but its
    own certificate comes from another CA: node-a refuses it on both peer planes, so its
    pull misses within the deadline (and node-a keeps serving members)."""
    authority, ca_file, secret = pki
    cert_a, cert_b, cert_c = (tmp_path / f"{n}.pem" for n in ("node-a", "node-b", "node-c"))
    authority.issue(cert_a, "node-a")
    CA("another CA").issue(cert_b, "node-b")
    authority.issue(cert_c, "node-c")
    a = node(start_daemon, redis_server.url, "node-a", cert_a, ca_file, secret)
    b = node(start_daemon, redis_server.url, "node-b", cert_b, ca_file, secret)
    keys, payloads = put_chain(a, 4, seed=3)
    wait_held(b, keys, "node-a")
    with Client(b.socket) as client:
        started = time.monotonic()
        result = client.prefetch(NS, keys=keys, timeout=DEADLINE_S)
        assert time.monotonic() - started < DEADLINE_S + 1
        assert result == {"pulled": 0, "already_local": 0, "missing": 4, "source": None}
        assert client.lookup(NS, keys=keys).matched_chunks == 0
    assert "refuses this client's certificate" in b.read_log()  # why, in the puller's log
    # its certificate on the transport port too: refused by the TLS handshake
    port = transport_port(a)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client_context(ca_file, cert_b).wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.recv(1)  # TLS 1.3: a refused client certificate shows at the first read
    with pytest.raises((AuthError, UnavailableError)):
        Client(
            ("127.0.0.1", a.info["tcp_port"]),
            timeout=3,
            reconnect=False,
            tls=ClientTLS(ca_file=str(ca_file), cert_file=str(cert_b)),
        )
    c = node(start_daemon, redis_server.url, "node-c", cert_c, ca_file, secret)
    with Client(c.socket) as client:  # a member still pulls
        assert client.prefetch(NS, keys=keys, timeout=DEADLINE_S)["pulled"] == 4
    assert_local(c, keys, payloads)


def test_a_certificate_reloaded_on_sighup_is_served_on_the_peer_planes(
    redis_server, start_daemon, tmp_path: Path, pki: tuple[CA, Path, Path]
) -> None:
    """After SIGHUP new connections to the TCP control and transport ports get the new
    certificate, and a pull over them still works; a certificate from another CA swapped in
    on the puller shuts it out from its next new link on (its reloaded client certificate
    is what it presents)."""
    authority, ca_file, secret = pki
    cert_a, cert_b, tool = (tmp_path / f"{n}.pem" for n in ("node-a", "node-b", "tool"))
    authority.issue(cert_a, "node-a")
    authority.issue(cert_b, "node-b")
    authority.issue(tool, "tool")
    a = node(start_daemon, redis_server.url, "node-a", cert_a, ca_file, secret)
    b = node(start_daemon, redis_server.url, "node-b", cert_b, ca_file, secret)
    second = authority.issue(cert_a, "node-a")
    assert a.proc is not None and b.proc is not None
    a.proc.send_signal(signal.SIGHUP)
    ports = (a.info["tcp_port"], transport_port(a))
    deadline = time.monotonic() + 5
    while any(served(port, ca_file, tool) != second for port in ports):
        assert time.monotonic() < deadline, "the reloaded certificate was not served"
        time.sleep(0.1)
    keys, payloads = put_chain(a, 4, seed=4)
    wait_held(b, keys, "node-a")
    with Client(b.socket) as client:
        assert client.prefetch(NS, keys=keys, timeout=DEADLINE_S)["pulled"] == 4
    assert_local(b, keys, payloads)
    # node-a restarts (a new incarnation: node-b needs new links) after node-b took a
    # certificate from another CA: its next links are refused
    CA("another CA").issue(cert_b, "node-b")
    b.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while "TLS certificate reloaded" not in b.read_log():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    a.stop()
    a2 = node(start_daemon, redis_server.url, "node-a", cert_a, ca_file, secret)
    more, _ = put_chain(a2, 2, seed=5)
    wait_held(b, more, "node-a")
    with Client(b.socket) as client:
        result = client.prefetch(NS, keys=more, timeout=DEADLINE_S)
        assert result["pulled"] == 0 and result["missing"] == 2
    assert "refuses this client's certificate" in b.read_log()
