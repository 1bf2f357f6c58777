"""Token checks, one module for both planes: who a token belongs to, and the control socket
and the HTTP API giving the same answer for the same token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from app_daemon import app_daemon
from fastapi.testclient import TestClient

from kvfabric.api.app import create_app
from kvfabric.auth import ADMIN, Principal, resolve
from kvfabric.config import AuthConfig
from kvfabric.errors import AuthError, ConfigError, ForbiddenError
from kvfabric.server.handlers import Context, hello
from kvfabric.server.session import Session
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, chunk_tokens=16)
AUTH = AuthConfig(token="admin-secret", tenants={"acme-secret": "acme", "globex-secret": "globex"})


def test_the_admin_token_resolves_to_the_admin() -> None:
    principal = resolve(AUTH, b"admin-secret")
    assert principal == ADMIN and principal.is_admin and principal.role == "admin"


def test_a_tenant_token_resolves_to_its_tenant() -> None:
    acme = resolve(AUTH, b"acme-secret")
    assert acme == Principal("acme") and acme.role == "tenant" and not acme.is_admin
    assert resolve(AUTH, b"globex-secret") == Principal("globex")


@pytest.mark.parametrize(
    "presented",
    [b"wrong", b"", None, b"admin-secret ", b"admin-secre", b"acme-secretX", b"ADMIN-SECRET"],
)
def test_a_wrong_missing_or_empty_token_is_refused(presented: bytes | None) -> None:
    assert resolve(AUTH, presented) is None


def test_with_no_token_configured_everyone_is_the_admin() -> None:
    off = AuthConfig()
    assert resolve(off, None) == ADMIN and resolve(off, b"anything") == ADMIN


def test_tenant_tokens_alone_turn_auth_on() -> None:
    tenants_only = AuthConfig(tenants={"acme-secret": "acme"})
    assert resolve(tenants_only, b"acme-secret") == Principal("acme")
    assert resolve(tenants_only, None) is None


def test_the_admin_token_wins_over_an_equal_tenant_token() -> None:
    same = AuthConfig(token="shared", tenants={"shared": "acme"})
    assert resolve(same, b"shared") == ADMIN


def test_the_token_file_is_read_on_every_call(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    auth = AuthConfig(token_file=str(token_file))
    assert resolve(auth, b"first") == ADMIN
    token_file.write_text("second\n")  # rotated
    assert resolve(auth, b"first") is None and resolve(auth, b"second") == ADMIN
    token_file.unlink()
    with pytest.raises(ConfigError, match="token_file"):
        resolve(auth, b"second")


def test_a_tenant_may_only_touch_its_own_namespaces() -> None:
    Principal("acme").check_namespace(Namespace("m", SPEC, tenant_salt="acme"))
    ADMIN.check_namespace(Namespace("m", SPEC, tenant_salt="globex"))
    with pytest.raises(ForbiddenError):
        Principal("acme").check_namespace(Namespace("m", SPEC, tenant_salt="globex"))


# -- both planes ---------------------------------------------------------------------------


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    with app_daemon(tmp_path, AUTH, 16 * SPEC.chunk_bytes) as daemon:
        yield TestClient(create_app(daemon))


def socket_answer(token: str | None) -> str | None:
    """What the control socket's hello makes of ``token``: "admin", the tenant, or
    "refused"."""
    store = SimpleNamespace(tier_names=["dram"])  # a remote session maps no arena
    ctx = Context(store=store, auth=AUTH, node_id="node-a", max_leases=1)  # type: ignore[arg-type]
    session = Session(local=False, max_leases=1)
    try:
        result, _fds = hello(ctx, session, {"token": token, "client": "test"})
    except AuthError:
        return "refused"
    return result["tenant"] or "admin"


def http_answer(http: TestClient, token: str | None) -> str | None:
    """What the HTTP API makes of ``token``: the admin may read stats; a tenant may look up
    its own tenant's namespace only."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    stats = http.get("/v1/stats", headers=headers).status_code
    if stats == 401:
        return "refused"
    if stats == 200:
        return "admin"
    assert stats == 403
    for tenant in ("acme", "globex"):
        ns = {"model": "m", "spec": SPEC.to_dict(), "tenant": tenant, "lora": ""}
        body = {"namespace": ns, "token_ids": [1, 2, 3]}
        status = http.post("/v1/lookup", json=body, headers=headers).status_code
        assert status in (200, 403)
        if status == 200:
            return tenant
    raise AssertionError("a tenant token that may look up no tenant")


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("admin-secret", "admin"),
        ("acme-secret", "acme"),
        ("globex-secret", "globex"),
        ("wrong", "refused"),
        ("", "refused"),
        (None, "refused"),
    ],
)
def test_both_planes_give_the_same_answer_for_the_same_token(
    http: TestClient, token: str | None, expected: str
) -> None:
    assert socket_answer(token) == expected
    assert http_answer(http, token) == expected
