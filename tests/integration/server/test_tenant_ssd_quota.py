"""Tenants' SSD quotas on a real daemon (``store.quotas.<tenant>.ssd``): a tenant flooding
the SSD tier gives up its own records, another tenant's SSD objects survive, and the
per-tenant SSD bytes in /v1/stats and /metrics are exact, across a restart too."""

from __future__ import annotations

import httpx
import pytest
from scrape import sample, scrape

from kvfabric.client import Client
from kvfabric.hashing import chunk_keys
from kvfabric.spec import KVSpec, Namespace

ADMIN, TOKEN_A, TOKEN_B = "admin-77f1", "tok-a", "tok-b"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=16)
CHUNK = SPEC.chunk_bytes  # 16 KiB
RECORD = CHUNK + 4096  # an SSD record: a header page, then the payload
SSD = 2 << 20  # 102 records
NS_A = Namespace("m", SPEC, tenant_salt="team-a")
NS_B = Namespace("m", SPEC, tenant_salt="team-b")
SETTINGS = [
    f"auth.token={ADMIN}",
    f"auth.tenants.{TOKEN_A}=team-a",
    f"auth.tenants.{TOKEN_B}=team-b",
    "store.tiers.dram.capacity=256KiB",
    "store.tiers.dram.page_size=4KiB",
    f"store.tiers.ssd.capacity={SSD}",
    "store.tiers.ssd.segment_bytes=256KiB",
]
QUOTA = "store.quotas.team-a.ssd=25%"


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch) -> None:
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)


def prompts(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    """Keys of ``n`` one-chunk prompts (each its own chain: an SSD leaf once there)."""
    return [
        chunk_keys(ns, list(range(i * 100, i * 100 + SPEC.chunk_tokens)))[0]
        for i in range(start, start + n)
    ]


def payload(key: bytes) -> bytes:
    return (key * (CHUNK // len(key)))[:CHUNK]


def ssd_stats(daemon) -> dict:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    assert (
        httpx.post(f"{daemon.http_url}/v1/admin/flush", headers=headers, timeout=60).status_code
        == 200
    )
    stats = httpx.get(f"{daemon.http_url}/v1/stats", headers=headers, timeout=10).json()
    return next(tier for tier in stats["tiers"] if tier["name"] == "ssd")


def flood(daemon) -> list[bytes]:
    """B stores 20 chunks, then A 400 (6.4 MiB through a 2 MiB SSD); B's keys."""
    b_keys = prompts(NS_B, 20, 1000)
    with Client(daemon.socket, token=TOKEN_B) as b:
        for key in b_keys:
            assert b.put(NS_B, key, payload(key))
    with Client(daemon.socket, token=TOKEN_A) as a:
        for key in prompts(NS_A, 400):
            assert a.put(NS_A, key, payload(key))
    return b_keys


def test_a_tenant_flooding_the_ssd_leaves_anothers_ssd_objects_alone(start_daemon) -> None:
    """Without a quota, A's flood evicts B's chunks from the SSD (the SSD's least recently
    used leaves go when it passes its high watermark): the attack is real. With
    ``store.quotas.team-a.ssd=25%`` every one of B's 20 chunks survives, byte-exact; A holds
    at most its quota; the per-tenant SSD bytes in /v1/stats and /metrics say so, survive a
    restart (re-indexed from the segment headers), and are 0 once everything is evicted.

    Regression: on the old code ``quotas.<tenant>.ssd`` was refused at start (the daemon
    exited 2), and without it B lost its chunks to A's flood."""
    open_daemon = start_daemon(*SETTINGS)
    b_keys = flood(open_daemon)
    with Client(open_daemon.socket, token=TOKEN_B) as b:
        assert not all(b.contains(NS_B, b_keys)), "the flood no longer evicts anything"
    open_daemon.stop()

    daemon = start_daemon(*SETTINGS, QUOTA)
    b_keys = flood(daemon)
    ssd = ssd_stats(daemon)
    assert ssd["tenant_bytes"]["team-b"] == 20 * RECORD
    # (A may hold less: a flood faster than compaction fills the SSD with A's dead records,
    # and a full disk costs A its own records too)
    assert ssd["tenant_bytes"]["team-a"] <= SSD // 4
    assert ssd["evictions"] > 0  # A's own records made room for A's next ones
    with Client(daemon.socket, token=TOKEN_B) as b:
        assert all(b.contains(NS_B, b_keys))
        for key in b_keys:
            with b.get(NS_B, key) as reader:
                assert reader.to_bytes() == payload(key)
    samples = scrape(daemon.http_url, ADMIN)
    assert (
        sample(samples, "kvfabric_tier_tenant_used_bytes", tier="ssd", tenant="team-b")
        == 20 * RECORD
    )
    assert (
        sample(samples, "kvfabric_tier_tenant_used_bytes", tier="dram", tenant="team-b") > 0
    )  # B's chunks just read back (their records stay)
    assert daemon.stop() == 0  # writes memory down to SSD first (A's within its quota)

    daemon = start_daemon(*SETTINGS, QUOTA, data_dir=daemon.data_dir)
    ssd = ssd_stats(daemon)
    assert ssd["tenant_bytes"]["team-b"] == 20 * RECORD  # from the records' metadata
    assert ssd["tenant_bytes"]["team-a"] <= SSD // 4  # with A's DRAM chunks written at stop
    with Client(daemon.socket, token=TOKEN_B) as b:
        assert all(b.contains(NS_B, b_keys))
    evicted = httpx.post(
        f"{daemon.http_url}/v1/admin/evict",
        json={},
        timeout=60,
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert evicted.status_code == 200 and evicted.json()["evicted"] >= 20
    ssd = ssd_stats(daemon)  # a charge the restart got wrong would show here (or go < 0)
    assert ssd["tenant_bytes"] == {"team-a": 0, "team-b": 0} and ssd["objects"] == 0
    assert "would go negative" not in daemon.read_log()
