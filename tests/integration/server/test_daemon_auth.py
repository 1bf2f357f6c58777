"""Authentication and tenant isolation on both planes of a daemon started with an admin
token and two tenant tokens (docs/architecture.md, "Tenants, quotas and authentication":
enforced by the daemon, not the client).
"""

from __future__ import annotations

import os
import socket

import httpx
import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.errors import AuthError, ForbiddenError, NotFoundError
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.frames import FrameDecoder, encode_frame
from kvfabric.protocol.messages import Op, encode_namespace, request
from kvfabric.spec import KVSpec, Namespace

ADMIN = "admin-7c1d0e"
TOKEN_A, TOKEN_B = "tok-a", "tok-b"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
NS_A = Namespace("m", SPEC, tenant_salt="team-a")
NS_B = Namespace("m", SPEC, tenant_salt="team-b")
NS_NONE = Namespace("m", SPEC)  # no tenant salt: only the admin may use it
SETTINGS = [
    "store.tiers.dram.capacity=4MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=16MiB",
    f"auth.token={ADMIN}",
    f"auth.tenants.{TOKEN_A}=team-a",
    f"auth.tenants.{TOKEN_B}=team-b",
]
PROTECTED = [
    ("GET", "/v1/stats"),
    ("POST", "/v1/lookup"),
    ("GET", "/metrics"),
    ("POST", "/v1/admin/evict"),
    ("POST", "/v1/admin/flush"),
]
# /metrics too: its tenant labels would show tenants each other (kvfabric/api/app.py)
ADMIN_ONLY = [
    ("GET", "/v1/stats"),
    ("GET", "/metrics"),
    ("POST", "/v1/admin/evict"),
    ("POST", "/v1/admin/flush"),
]


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("auth-node", *SETTINGS)


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch) -> None:
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)  # the client would pick it up


@pytest.fixture
def http(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=30) as client:
        yield client


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, SPEC.chunk_bytes, dtype=np.uint8
    )


def body_for(path: str, ns: Namespace = NS_A) -> dict | None:
    if path == "/v1/lookup":
        return {"namespace": encode_namespace(ns), "token_ids": list(range(32))}
    if path == "/v1/admin/evict":
        return {"tier": "dram", "bytes": 1}
    if path == "/v1/admin/flush":
        return None
    return None


def call(
    http: httpx.Client,
    method: str,
    path: str,
    token: str | None = None,
    ns: Namespace = NS_A,
    scheme: str = "Bearer",
) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"{scheme} {token}".strip()}
    body = body_for(path, ns)
    return (
        http.request(method, path, headers=headers, json=body)
        if body is not None
        else http.request(method, path, headers=headers)
    )


# ---------------------------------------------------------------------- socket


def raw_hello(path: str, args: dict) -> tuple[dict, bool]:
    """(hello reply, whether the daemon then closed the connection)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(path)
    try:
        sock.sendall(encode_frame(request(1, Op.HELLO, args)))
        decoder = FrameDecoder()
        replies: list[dict] = []
        while not replies:
            data = sock.recv(1 << 16)
            assert data, "closed without a reply"
            replies.extend(decoder.feed(data))
        if replies[0]["ok"]:
            return replies[0], False
        sock.sendall(encode_frame(request(2, Op.PING, {})))  # may fail: already closed
        rest = sock.recv(1 << 16)
        return replies[0], rest == b""
    except (BrokenPipeError, ConnectionResetError):
        return replies[0], True
    finally:
        sock.close()


@pytest.mark.parametrize(
    "token",
    [
        None,
        "",
        "wrong",
        ADMIN + "x",
        ADMIN[:-1],
        TOKEN_A.upper(),
        "team-a",
        42,
        ["tok-a"],
        {"t": ADMIN},
    ],
)
def test_missing_or_wrong_token_is_refused_on_the_socket(daemon, token) -> None:
    args = {"client": "test"} if token is None else {"client": "test", "token": token}
    reply, closed = raw_hello(daemon.socket, args)
    assert reply["ok"] is False and reply["error"]["kind"] == "unauthorized", reply
    assert closed, "a refused session must be closed"
    if isinstance(token, str) or token is None:
        with pytest.raises(AuthError):
            Client(daemon.socket, token=token, reconnect=False)


def test_admin_token_works_everywhere_on_the_socket(daemon) -> None:
    with Client(daemon.socket, token=ADMIN) as client:
        assert client._session().hello["tenant"] is None
        assert client.stats()["objects"] >= 0
        for ns in (NS_A, NS_B, NS_NONE):
            key = os.urandom(16)
            assert client.put(ns, key, payload(key))
            assert client.contains(ns, [key]) == [True]
            with client.get(ns, key) as reader:
                assert reader.to_bytes() == payload(key).tobytes()
            assert client.lookup(ns, keys=[key]).matched_chunks == 1
            assert client.delete(ns, key) is True


def test_tenant_token_reads_and_writes_its_own_namespace(daemon) -> None:
    with Client(daemon.socket, token=TOKEN_A) as client:
        assert client._session().hello["tenant"] == "team-a"
        refs = chunk_hashes(NS_A, list(range(48)))
        for ref in refs:
            assert client.put(NS_A, ref.key, payload(ref.key), parent=ref.parent)
        hit = client.lookup(NS_A, list(range(48)))
        assert hit.matched_chunks == 3
        for ref in refs:
            with client.get(NS_A, ref.key) as reader:
                assert reader.to_bytes() == payload(ref.key).tobytes()
        assert client.delete(NS_A, refs[-1].key) is True
        assert client.contains(NS_A, [r.key for r in refs]) == [True, True, False]


@pytest.mark.parametrize(
    "ns",
    [NS_B, NS_NONE, Namespace("other-model", SPEC, "team-b")],
    ids=["other-tenant", "no-tenant", "other-model-other-tenant"],
)
def test_tenant_token_cannot_touch_another_namespace_on_the_socket(daemon, ns) -> None:
    key = os.urandom(16)
    with Client(daemon.socket, token=ADMIN) as admin:
        assert admin.put(ns, key, payload(key))
    with Client(daemon.socket, token=TOKEN_A, reconnect=False) as client:
        attempts = {
            "lookup": lambda: client.lookup(ns, keys=[key]),
            "lookup_tokens": lambda: client.lookup(ns, list(range(32))),
            "reserve": lambda: client.reserve(ns, os.urandom(16)),
            "put": lambda: client.put(ns, os.urandom(16), payload(key)),
            "get": lambda: client.get(ns, key),
            "contains": lambda: client.contains(ns, [key]),
            "delete": lambda: client.delete(ns, key),
            "stats": client.stats,
        }
        for name, attempt in attempts.items():
            try:
                attempt()
            except ForbiddenError:
                pass
            else:
                pytest.fail(f"a tenant token was allowed {name} in {ns}")
            client.ping()  # refused requests do not cost the session
        # and its own tenant salt does not reach the other tenant's object either
        with pytest.raises(NotFoundError):
            client.get(Namespace(ns.model_id, SPEC, "team-a"), key)
    with Client(daemon.socket, token=ADMIN) as admin:  # untouched
        assert admin.contains(ns, [key]) == [True]
        with admin.get(ns, key) as reader:
            assert reader.to_bytes() == payload(key).tobytes()


def test_tenants_are_isolated_from_each_other(daemon) -> None:
    """Tenant B can neither read A's object nor learn that it exists: storing B's own
    object under the same 16-byte key must not collide with A's (the daemon enforces the
    namespace on writes as it does on reads; an 'already stored' answer would be an
    existence oracle across tenants, and would let B squat A's future keys)."""
    key = os.urandom(16)
    with Client(daemon.socket, token=TOKEN_A) as a, Client(daemon.socket, token=TOKEN_B) as b:
        assert a.put(NS_A, key, payload(key))
        with pytest.raises(ForbiddenError):
            b.get(NS_A, key)
        with pytest.raises(ForbiddenError):
            b.delete(NS_A, key)
        assert b.contains(NS_B, [key]) == [False]
        assert b.lookup(NS_B, keys=[key]).matched_chunks == 0
        assert b.put(NS_B, key, payload(key)[::-1].copy()) is True  # its own namespace
        with b.get(NS_B, key) as reader:
            assert reader.to_bytes() == payload(key)[::-1].tobytes()
        with a.get(NS_A, key) as reader:
            assert reader.to_bytes() == payload(key).tobytes()


# ---------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("method,path", PROTECTED)
@pytest.mark.parametrize(
    "token,scheme",
    [
        (None, "Bearer"),
        ("wrong", "Bearer"),
        (ADMIN + "x", "Bearer"),
        ("", "Bearer"),
        (ADMIN, "Basic"),
        ("team-a", "Bearer"),
    ],
)
def test_missing_or_wrong_token_is_401_over_http(http, method, path, token, scheme) -> None:
    response = call(http, method, path, token, scheme=scheme)
    assert response.status_code == 401, response.text
    assert response.headers.get("www-authenticate", "").lower().startswith("bearer")
    if path != "/metrics":
        assert response.json()["error"]["kind"] == "unauthorized"


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes_are_open(http, path) -> None:
    response = http.get(path)
    assert response.status_code == 200
    assert response.json()["status"] in ("ok", "ready")
    assert http.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 200


@pytest.mark.parametrize("method,path", PROTECTED)
def test_admin_token_works_everywhere_over_http(http, method, path) -> None:
    for ns in (NS_A, NS_B, NS_NONE):
        response = call(http, method, path, ADMIN, ns=ns)
        assert response.status_code == 200, response.text
    if path == "/metrics":
        assert "kvfabric_" in response.text


def test_tenant_token_over_http(daemon, http) -> None:
    refs = chunk_hashes(NS_A, list(range(32)))
    with Client(daemon.socket, token=TOKEN_A) as client:
        for ref in refs:
            client.put(NS_A, ref.key, payload(ref.key), parent=ref.parent)
    own = http.post(
        "/v1/lookup",
        headers={"Authorization": f"Bearer {TOKEN_A}"},
        json={"namespace": encode_namespace(NS_A), "token_ids": list(range(40))},
    )
    assert own.status_code == 200, own.text
    assert own.json()["matched_tokens"] == 32
    by_hash = http.post(
        "/v1/lookup",
        headers={"Authorization": f"Bearer {TOKEN_A}"},
        json={"namespace": encode_namespace(NS_A), "chunk_hashes": [r.key.hex() for r in refs]},
    )
    assert by_hash.status_code == 200 and by_hash.json()["matched_chunks"] == 2
    for ns in (NS_B, NS_NONE):
        response = call(http, "POST", "/v1/lookup", TOKEN_A, ns=ns)
        assert response.status_code == 403, response.text
        assert response.json()["error"]["kind"] == "forbidden"
    for method, path in ADMIN_ONLY:
        response = call(http, method, path, TOKEN_A)
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["kind"] == "forbidden"
        assert "kvfabric_" not in response.text
    # the refused admin calls did nothing: the tenant's objects are all still there
    with Client(daemon.socket, token=TOKEN_A) as client:
        assert client.contains(NS_A, [r.key for r in refs]) == [True, True]


def test_inline_yaml_mapping_for_tenants_is_accepted(start_daemon, http) -> None:
    """``--set auth.tenants={tok-c: team-c}``: a YAML mapping given inline on the command
    line configures the tenants like the dotted form does."""
    daemon = start_daemon(
        "store.tiers.dram.capacity=4MiB",
        "store.tiers.dram.page_size=16KiB",
        "store.tiers.ssd.capacity=16MiB",
        f"auth.token={ADMIN}",
        "auth.tenants={tok-c: team-c, tok-d: team-d}",
    )
    ns_c = Namespace("m", SPEC, tenant_salt="team-c")
    with Client(daemon.socket, token="tok-c") as client:
        assert client._session().hello["tenant"] == "team-c"
        key = os.urandom(16)
        assert client.put(ns_c, key, payload(key))
        with pytest.raises(ForbiddenError):
            client.contains(Namespace("m", SPEC, tenant_salt="team-d"), [key])
    with pytest.raises(AuthError):
        Client(daemon.socket, token="tok-a", reconnect=False)
