"""The status page (``GET /ui``) of a real daemon (``kvfabric serve`` as a subprocess, auth
on) in headless Chromium driven by Playwright: it renders, shows what ``/v1/stats``,
``/v1/nodes`` and ``/v1/transfers/recent`` say after real client traffic, follows new
traffic without a reload, and shows an auth error instead of numbers under a wrong token.

A screenshot of each page lands in ``$KVF_TEST_ARTIFACTS`` (default ``tests/artifacts/``;
not a ``KVFABRIC_*`` name: the daemon reads every such variable as a setting and refuses to
start on an unknown one). The browser tests skip when Playwright or Chromium is missing
(``apt-get install chromium``; Playwright drives that binary: ``$KVF_CHROMIUM``, else
``/usr/bin/chromium``); the transfers test needs neither.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

ROOT = Path(__file__).resolve().parents[3]
ADMIN, TENANT = "ui-admin-5e1f", "ui-tenant-77"
SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NS = Namespace("ui-model", SPEC, tenant_salt="acme")
CT = SPEC.chunk_tokens
ENGINE = "ui-test-engine"
# DRAM holds 8 chunks: a longer prompt spills to SSD, so both tiers have something to show.
# Watermarks at 1: only puts move chunks, never the background pass between two reads.
SETTINGS = [
    "store.tiers.dram.capacity=128KiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=32MiB",
    "node_id=ui-node-1",
    "cluster.hardware_class=cpu-ui-test",
    "store.high_watermark=1.0",
    "store.low_watermark=1.0",
    f"auth.token={ADMIN}",
    f"auth.tenants.{TENANT}=acme",
]
WAIT_MS = 30_000  # for the page to catch up: polls are 1.5 s apart, on a loaded 2-core host


# ---------------------------------------------------------------------- daemon and traffic


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("ui-node", *SETTINGS)


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch) -> None:
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)  # the client would pick it up


@pytest.fixture
def http(daemon) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=daemon.http_url, headers=headers, timeout=30) as client:
        yield client


@pytest.fixture
def client(daemon) -> Iterator[Client]:
    with Client(daemon.socket, token=ADMIN, engine=ENGINE) as client:
        yield client


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, SPEC.chunk_bytes, dtype=np.uint8
    )


def put_prompt(client: Client, n_chunks: int, start: int) -> list[bytes]:
    refs = chunk_hashes(NS, list(range(start, start + n_chunks * CT)))
    for ref in refs:
        client.put(NS, ref.key, payload(ref.key), parent=ref.parent)
    return [r.key for r in refs]


def stats(http: httpx.Client) -> dict[str, Any]:
    response = http.get("/v1/stats")
    assert response.status_code == 200, response.text
    return response.json()


def quiet_stats(http: httpx.Client) -> dict[str, Any]:
    """/v1/stats once the daemon has stopped changing (SSD writes flushed, nothing moving)."""
    http.post("/v1/admin/flush").raise_for_status()
    before = stats(http)
    after = stats(http)
    for body in (before, after):
        body.pop("uptime_s")
    assert before == after, "the store still changes with no traffic"
    return after


def test_recent_transfers_record_a_real_daemons_puts_and_gets(daemon, http, client) -> None:
    """Without a browser: what the control plane records, read back over HTTP."""
    recorded = http.get("/v1/transfers/recent").json()["recorded"]
    keys = put_prompt(client, 3, start=10_000)
    pin = client.get(NS, keys[0])
    pin.release()
    body = http.get("/v1/transfers/recent", params={"limit": 4}).json()
    assert body["recorded"] == recorded + 4 and body["capacity"] >= 4
    get, *puts = body["transfers"]
    assert get["kind"] == "get" and get["peer"] == ENGINE and get["chunks"] == 1
    assert get["bytes"] == SPEC.chunk_bytes and get["seconds"] is None
    assert [p["kind"] for p in puts] == ["put"] * 3
    assert all(p["peer"] == ENGINE and p["bytes"] == SPEC.chunk_bytes for p in puts)
    assert [t["seq"] for t in body["transfers"]] == list(
        range(recorded + 4, recorded, -1)
    )  # newest first, consecutive
    # a tenant's token may not read them, a wrong one nothing at all
    tenant = http.get("/v1/transfers/recent", headers={"Authorization": f"Bearer {TENANT}"})
    assert tenant.status_code == 403
    wrong = http.get("/v1/transfers/recent", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


# ---------------------------------------------------------------------- the browser


def chromium_path() -> str | None:
    path = os.environ.get("KVF_CHROMIUM") or "/usr/bin/chromium"
    return path if os.access(path, os.X_OK) else shutil.which("chromium")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
    )
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium binary (apt-get install chromium, or set KVF_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    directory = Path(os.environ.get("KVF_TEST_ARTIFACTS") or ROOT / "tests" / "artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class Page:
    """A fresh browser context (its own sessionStorage) on the daemon's /ui, with what the
    page requested, navigated to and complained about."""

    def __init__(self, browser: Any, base_url: str) -> None:
        self.base_url = base_url
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.requests: list[str] = []
        self.navigations = 0
        self.console: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("framenavigated", self._navigated)
        self.page.set_default_timeout(WAIT_MS)

    def _navigated(self, frame: Any) -> None:
        if frame == self.page.main_frame:
            self.navigations += 1

    def open(self) -> None:
        response = self.page.goto(f"{self.base_url}/ui")
        assert response is not None and response.status == 200

    def use_token(self, token: str) -> None:
        self.page.locator("#token").fill(token)
        self.page.locator("#token-save").click()

    def value(self, selector: str) -> str | None:
        return self.page.locator(selector).get_attribute("data-value")

    def polls(self) -> int:
        return int(self.value("#polls") or 0)

    def wait_polls(self, n: int) -> None:
        self.page.wait_for_function(
            "n => Number(document.getElementById('polls').dataset.value) >= n", arg=n
        )

    def wait_value(self, selector: str, value: str) -> None:
        self.page.wait_for_function(
            "([s, v]) => document.querySelector(s)?.dataset.value === v", arg=[selector, value]
        )

    def check_clean(self) -> None:
        """Nothing blocked by the CSP, no script error, no request off this origin."""
        assert not self.errors, self.errors
        assert not [m for m in self.console if "Content Security Policy" in m], self.console
        foreign = [u for u in self.requests if not u.startswith(self.base_url + "/")]
        assert not foreign, foreign

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, daemon, artifacts, request) -> Iterator[Page]:
    page = Page(browser, daemon.http_url)
    yield page
    # how the page was left, pass or fail: what to look at when an assertion above failed
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in request.node.name).strip("-")
    page.page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)
    page.close()


def test_the_page_shows_the_daemons_numbers_and_follows_them_live(
    daemon, http, client, page, artifacts
) -> None:
    page.open()
    # auth is on and the page has no token yet: it asks for one and shows no numbers
    page.page.locator("#auth-error").wait_for(state="visible")
    assert "needs a token" in page.page.locator("#auth-error").inner_text()
    assert page.page.locator("#data").is_hidden()

    page.use_token(ADMIN)
    page.wait_polls(1)  # the first sample: the hit-rate window starts here
    assert page.page.locator("#auth").is_hidden() and page.page.locator("#data").is_visible()
    assert ADMIN not in page.page.url  # kept in the tab's sessionStorage, not in any URL
    assert page.page.evaluate("sessionStorage.getItem('kvfabric.token')") == ADMIN
    before = quiet_stats(http)

    # traffic: 12 chunks into 8 chunks of DRAM (the rest spills to SSD), a lookup of 14
    # chunks that finds 12, and two reads
    keys = put_prompt(client, 12, start=0)
    hit = client.lookup(NS, list(range(14 * CT)))
    assert hit.matched_tokens == 12 * CT
    for key in keys[-2:]:
        client.get(NS, key).release()
    after = quiet_stats(http)
    totals = after["totals"]
    assert totals["lookup_tokens"] - before["totals"]["lookup_tokens"] == 14 * CT

    # the page catches up without a reload, then shows exactly what /v1/stats says
    page.wait_value("#total-lookup_tokens", str(totals["lookup_tokens"]))
    polls = page.polls()
    page.wait_polls(polls + 1)  # one more full poll: every section is from the same state
    assert page.page.locator("#node-id").inner_text() == "ui-node-1"
    assert page.value("#status") == "ready"
    for field in (
        "objects",
        "puts",
        "gets",
        "lookups",
        "lookup_tokens",
        "hit_tokens",
        "miss_tokens",
        "evictions",
    ):
        assert page.value(f"#total-{field}") == str(totals[field]), field
    assert float(page.value("#total-hit_rate") or "nan") == pytest.approx(totals["hit_rate"])
    assert [row.get_attribute("data-tier") for row in page.page.locator("#tiers tr").all()] == [
        t["name"] for t in after["tiers"]
    ]
    for tier in after["tiers"]:
        row = f"#tiers tr[data-tier='{tier['name']}']"
        for field in ("objects", "used_bytes", "capacity_bytes", "hit_tokens", "demotions"):
            assert page.value(f"{row} td[data-field='{field}']") == str(tier[field]), field
        assert float(page.value(f"{row} td[data-field='utilisation']") or "nan") == (
            pytest.approx(tier["utilisation"])
        )
    assert int(page.value("#tiers tr[data-tier='ssd'] td[data-field='objects']") or 0) > 0

    # the hit rate over the window: counters differenced since the page's first poll
    window_lookup = totals["lookup_tokens"] - before["totals"]["lookup_tokens"]
    window_hit = totals["hit_tokens"] - before["totals"]["hit_tokens"]
    assert page.value("#window-lookup-tokens") == str(window_lookup)
    assert page.value("#window-hit-tokens") == str(window_hit)
    assert float(page.value("#window-hit-rate") or "nan") == pytest.approx(12 / 14)
    by_tier = {t["name"]: t["hit_tokens"] for t in after["tiers"]}
    for name, tokens in by_tier.items():
        moved = tokens - {t["name"]: t["hit_tokens"] for t in before["tiers"]}[name]
        assert page.value(f"#window-tiers tr[data-tier='{name}'] td[data-field='hit_tokens']") == (
            str(moved)
        )

    # recent transfers: the endpoint's newest rows, our engine's reads and writes
    recent = http.get("/v1/transfers/recent", params={"limit": 20}).json()
    assert page.value("#transfers-recorded") == str(recent["recorded"])
    rows = page.page.locator("#transfers tr").all()
    assert [r.get_attribute("data-seq") for r in rows] == [
        str(t["seq"]) for t in recent["transfers"]
    ]
    newest = "#transfers tr:first-child"
    assert page.value(f"{newest} td[data-field='kind']") == "get"
    assert page.value(f"{newest} td[data-field='peer']") == ENGINE
    assert page.value(f"{newest} td[data-field='bytes']") == str(SPEC.chunk_bytes)

    # cluster nodes: the embedded index of a lone node, so this node, with its hardware class
    nodes = http.get("/v1/nodes").json()
    assert page.value("#cluster-mode") == str(nodes["cluster"]).lower()
    assert [r.get_attribute("data-node") for r in page.page.locator("#nodes tr").all()] == [
        n["node_id"] for n in nodes["nodes"]
    ]
    assert page.value("#nodes tr[data-node='ui-node-1'] td[data-field='hardware_class']") == (
        "cpu-ui-test"
    )

    # live: more traffic, and the same document (no navigation) shows it
    page.page.evaluate("window.__sameDocument = 'yes'")
    navigations = page.navigations
    client.lookup(NS, list(range(4 * CT)))  # 4 more chunks, all hits
    lookup_tokens = stats(http)["totals"]["lookup_tokens"]
    assert lookup_tokens == totals["lookup_tokens"] + 4 * CT
    page.wait_value("#total-lookup_tokens", str(lookup_tokens))
    page.wait_value("#window-lookup-tokens", str(window_lookup + 4 * CT))
    assert page.navigations == navigations == 1
    assert page.page.evaluate("window.__sameDocument") == "yes"
    assert page.page.evaluate("performance.getEntriesByType('navigation').length") == 1
    assert float(page.value("#window-hit-rate") or "nan") == pytest.approx(16 / 18)

    page.page.screenshot(path=str(artifacts / "status-page.png"), full_page=True)
    page.check_clean()


@pytest.mark.parametrize(
    ("name", "token", "message"),
    [("wrong", "not-the-token", "refused the token"), ("tenant", TENANT, "needs the admin token")],
    ids=["wrong-token", "tenant-token"],
)
def test_a_refused_token_shows_an_auth_error_not_numbers(
    daemon, http, client, page, artifacts, name, token, message
) -> None:
    put_prompt(client, 1, start=50_000)  # something to show, were the page allowed to
    page.open()
    page.page.locator("#auth-error").wait_for(state="visible")
    page.use_token(token)
    page.page.wait_for_function(
        "m => document.getElementById('auth-error').textContent.includes(m)", arg=message
    )
    assert page.page.locator("#data").is_hidden()
    assert page.polls() == 0  # not one poll got through
    assert page.page.locator("#tiers tr").count() == 0
    assert page.page.locator("#transfers tr").count() == 0
    assert page.page.locator("#totals dd").count() == 0
    assert page.page.locator("#status").inner_text() == "unauthorized"
    page.page.screenshot(path=str(artifacts / f"status-page-{name}-token.png"))

    # the right token then works in the same page, and forgetting it asks again
    page.use_token(ADMIN)
    page.wait_polls(1)
    assert page.page.locator("#data").is_visible() and page.page.locator("#auth").is_hidden()
    page.page.locator("#token-forget").click()
    page.page.locator("#auth-error").wait_for(state="visible")
    assert page.page.locator("#data").is_hidden()
    assert page.page.locator("#node-id").inner_text() == ""  # nothing left from before
    assert page.page.locator("#uptime").inner_text() == ""
    assert page.page.evaluate("sessionStorage.getItem('kvfabric.token')") is None
    page.check_clean()


def test_without_auth_the_page_needs_no_token_and_its_csp_holds(
    browser, start_daemon, artifacts
) -> None:
    """Auth off (a loopback-only node): the page polls at once. The CSP is live in the
    browser: an injected inline script does not run and a fetch elsewhere is refused."""
    open_daemon = start_daemon(
        *(s for s in SETTINGS if not s.startswith("auth.")), "node_id=ui-open"
    )
    page = Page(browser, open_daemon.http_url)
    try:
        page.open()
        page.wait_polls(1)
        assert page.page.locator("#auth").is_hidden() and page.page.locator("#data").is_visible()
        assert page.page.locator("#node-id").inner_text() == "ui-open"
        assert page.page.locator("#token-forget").is_hidden()
        page.check_clean()

        page.page.evaluate(
            "() => { const s = document.createElement('script');"
            " s.textContent = 'window.__injected = 1'; document.body.append(s); }"
        )
        assert page.page.evaluate("window.__injected") is None
        refused = page.page.evaluate(
            "() => fetch('http://127.0.0.2:9/').then(() => 'fetched', e => String(e))"
        )
        assert refused != "fetched"
        page.page.wait_for_timeout(200)  # the violation reports are asynchronous
        violations = [m for m in page.console if "Content Security Policy" in m]
        assert any("script" in m for m in violations), page.console
        assert any("connect-src" in m for m in violations), page.console
    finally:
        page.close()
