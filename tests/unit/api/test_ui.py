"""The status page's document and headers (kvfabric/api/ui.py): served to anyone, a strict
CSP naming exactly its inline blocks, nothing loaded from anywhere else. The browser side is
tests/integration/api/test_status_page.py."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from app_daemon import app_daemon
from fastapi.testclient import TestClient

from kvfabric.api.app import create_app
from kvfabric.api.ui import content_security_policy
from kvfabric.config import AuthConfig
from kvfabric.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with app_daemon(tmp_path, AuthConfig(token="admin-secret"), 16 * SPEC.chunk_bytes) as daemon:
        yield TestClient(create_app(daemon))


def sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def directives(policy: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in (p.strip() for p in policy.split(";")) if d}


def test_the_page_is_served_without_a_token_and_holds_no_data(client: TestClient) -> None:
    response = client.get("/ui")  # auth is on: the page is static, its data is not
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert "node-a" not in response.text  # nothing of the daemon's state is in it
    assert client.get("/v1/stats").status_code == 401  # what it reads still needs a token


def test_the_csp_allows_only_the_pages_own_inline_blocks_and_this_origin(
    client: TestClient,
) -> None:
    response = client.get("/ui")
    policy = directives(response.headers["content-security-policy"])
    (script,) = re.findall(r"<script>(.*?)</script>", response.text, flags=re.DOTALL)
    (style,) = re.findall(r"<style>(.*?)</style>", response.text, flags=re.DOTALL)
    assert policy["default-src"] == ["'none'"]
    assert policy["script-src"] == [sha256_source(script)]
    assert policy["style-src"] == [sha256_source(style)]
    assert policy["connect-src"] == ["'self'"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["form-action"] == ["'none'"]
    assert policy["base-uri"] == ["'none'"]
    assert not any("unsafe" in source for sources in policy.values() for source in sources)
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["cache-control"] == "no-store"


def test_the_document_loads_nothing_from_elsewhere_and_has_no_inline_handlers(
    client: TestClient,
) -> None:
    html = client.get("/ui").text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert not re.search(r"\bon[a-z]+\s*=\s*[\"']", html)  # the CSP would refuse them
    assert not re.search(r"\sstyle\s*=", html)  # style attributes too
    assert "innerHTML" not in html  # server strings are set as text only
    assert "localStorage" not in html  # the token lives in sessionStorage, per tab
    # every fetch is a path on this origin
    for path in re.findall(r"""api\(["']([^"']+)""", html):
        assert path.startswith("/v1/"), path


def test_a_document_with_a_second_script_block_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly one <script>"):
        content_security_policy("<style></style><script>a</script><script>b</script>")
