"""A daemon's counters agree with what happened (issue 12): a missed partial last chunk counts
its real tokens, a refused session is a failed request, and ``kvfabric status`` says which
lookups its per-tenant rows do not hold. One real daemon with auth on, read through its
``/metrics`` and the same stats ``kvfabric status`` prints."""

from __future__ import annotations

import numpy as np
import pytest
from scrape import sample, scrape

from kvfabric.client import Client
from kvfabric.commands.stats_table import UNATTRIBUTED, UNATTRIBUTED_NOTE, from_store_stats, render
from kvfabric.errors import AuthError, ProtocolError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

ADMIN = "admin-counters-41f"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
NS = Namespace("counters-model", SPEC)
PROMPT = list(range(72))  # four full chunks and a partial one of 8 tokens


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(
        "counters",
        "store.tiers.dram.capacity=4MiB",
        "store.tiers.dram.page_size=16KiB",
        "store.tiers.ssd.capacity=16MiB",
        f"auth.token={ADMIN}",
    )


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch) -> None:
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)


def tokens_counted(daemon) -> tuple[float, float]:
    """(lookup tokens, miss tokens) over every tenant label."""
    samples = scrape(daemon.http_url, ADMIN)

    def total(name: str) -> float:
        return sum(v for (n, _), v in samples.items() if n == name)

    return total("kvfabric_lookup_tokens_total"), total("kvfabric_miss_tokens_total")


def test_a_missed_partial_chunk_counts_its_real_tokens(daemon) -> None:
    """Regression: on the old code a 72-token prompt looked up by its five keys counted 80
    tokens looked up and missed (the partial chunk as a full 16)."""
    keys = [ref.key for ref in chunk_hashes(NS, PROMPT)]
    with Client(daemon.socket, token=ADMIN) as client:
        before = tokens_counted(daemon)
        result = client.lookup(NS, keys=keys, num_tokens=len(PROMPT))
        assert (result.matched_chunks, result.requested_tokens) == (0, 72)
        after = tokens_counted(daemon)
        assert (after[0] - before[0], after[1] - before[1]) == (72, 72)
        # a client that does not say counts full chunks, as before
        assert client.lookup(NS, keys=keys).requested_tokens == 80
        # the partial chunk stored: a full hit, by its real tokens
        refs = chunk_hashes(NS, PROMPT)
        client.put_many(
            NS, refs, [np.zeros(SPEC.layout(r.num_tokens).nbytes, np.uint8) for r in refs]
        )
        hit = client.lookup(NS, keys=keys, num_tokens=72)
        assert (hit.matched_tokens, hit.requested_tokens, hit.miss_tokens) == (72, 72, 0)
        for wrong in (64, 81, 0):  # not what five keys can cover
            with pytest.raises(ProtocolError, match="num_tokens"):
                client.lookup(NS, keys=keys, num_tokens=wrong)


def test_a_refused_session_is_a_failed_hello_request(daemon) -> None:
    """Regression: on the old code a refused session showed only in
    kvfabric_control_connections_closed_total, never in kvfabric_request_errors_total."""

    def refused() -> float:
        return sample(
            scrape(daemon.http_url, ADMIN),
            "kvfabric_request_errors_total",
            plane="control",
            op="hello",
            kind="unauthorized",
        )

    before = refused()
    for token in (None, "not-the-token"):
        with pytest.raises(AuthError):
            Client(daemon.socket, token=token, reconnect=False)
    assert refused() - before == 2
    with Client(daemon.socket, token=ADMIN) as client:  # the control: admitted, not counted
        client.ping()
    assert refused() - before == 2


def test_status_rows_and_totals_add_up_and_the_difference_is_labelled(daemon) -> None:
    """Regression: on the old code `kvfabric status` printed per-tenant rows whose lookups
    summed to less than its totals (lookups in namespaces the node holds nothing of are
    counted in the totals only) without a word about it."""
    stored = Namespace("counters-model", SPEC, tenant_salt="team-s")
    refs = chunk_hashes(stored, PROMPT[:32])
    with Client(daemon.socket, token=ADMIN) as client:
        client.put_many(stored, refs, [np.zeros(SPEC.chunk_bytes, np.uint8) for _ in refs])
        client.lookup(stored, keys=[r.key for r in refs])
        for salt in ("nobody-1", "nobody-2"):  # namespaces this node never held
            client.lookup(
                Namespace("counters-model", SPEC, tenant_salt=salt), keys=[r.key for r in refs]
            )
        doc = from_store_stats(client.stats(), node_id=client.node_id)
    text = render(doc)
    rows = text.split(f"{'tenant':20}", 1)[1].splitlines()[1:]
    lookups = {
        line[:20].strip(): int(line.split()[-2])
        for line in rows
        if line and not line.startswith(UNATTRIBUTED + ":")
    }
    assert lookups["team-s"] == 1
    assert UNATTRIBUTED in lookups and lookups[UNATTRIBUTED] >= 2
    assert sum(lookups.values()) == doc["totals"]["lookups"]
    assert UNATTRIBUTED_NOTE in text
