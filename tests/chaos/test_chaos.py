"""The chaos suite, CI-sized: two daemons, Redis and two tenants' clients through every kind
of fault once (kill -9 and restart, SIGSTOP / SIGCONT, Redis restarted empty, a disk filled
and freed, a flood of unauthenticated connections with oversized and slowloris HTTP, a
writer frozen past its lease), with the invariants checked while it runs.

The harness is ``tests/support/chaos_harness.py`` (``benchmarks/soak.py`` runs the same one,
longer); one run serves every test of this module, each test one invariant, so a failure
names the promise that broke. Every fault must actually have happened: each test also
checks that its checker had something to check (chunks on SSD, reads verified, cross-tenant
attempts made, pings and sessions under attack), so none passes vacuously.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chaos_harness import CI, run

pytestmark = pytest.mark.timeout(900)  # the module's one run counts against its first test


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(CI, Path(tmp_path_factory.mktemp("chaos")))


def event(chaos: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [e for e in chaos["events"] if e["kind"] == kind]
    assert found, f"no {kind} fault ran: {chaos['events']}"
    return found[0]


def test_no_wrong_kv_is_ever_served(chaos) -> None:
    """Every read (readers, the final sweep of every acknowledged chunk) is byte-exact.

    Regression: on the old code a tenant could overwrite another tenant's pages through its
    read-write mapping of the whole arena (B's get returned A's bytes)."""
    assert chaos["verified_reads"] > 200 and chaos["acked_puts"] > 200
    assert sum(chaos["final_sweep"].values()) > 100
    assert chaos["corrupt_reads_other"] == 0, chaos["corrupt_samples"]


def test_a_writer_frozen_past_its_lease_corrupts_nothing(chaos) -> None:
    """Regression: on the old code a writer SIGSTOPped past its lease that resumed writing
    through its page views wrote into pages already handed to another object (1 of 16 of
    another client's chunks served wrong)."""
    frozen = event(chaos, "frozen_writer")
    assert frozen["lease_reaped"], frozen
    assert frozen["commit"] == "lease_expired", frozen
    assert frozen["victims"].get("ok", 0) >= 12, frozen
    assert chaos["corrupt_reads_frozen_writer"] == 0, chaos["corrupt_samples"]
    assert frozen["ok"], frozen


def test_no_acknowledged_ssd_chunk_is_lost(chaos) -> None:
    """Chunks a node reported in its SSD tier survive kill -9, a full disk and Redis loss.

    Regression: on the old code a full disk evicted SSD data that was already stored (577 ->
    210 objects, sampled chunks not_found for good)."""
    audit = chaos["ssd_audit"]
    assert audit["ssd_known_total"] >= 20, audit
    assert chaos["lost_acked_ssd_objects"] == 0, audit["lost_samples"]


def test_no_tenant_reads_another_tenants_bytes(chaos) -> None:
    """Neither through the API (another tenant's namespace, or its raw keys in one's own)
    nor in the arena memory a tenant's client has mapped.

    Regression: on the old code every client, tenant-token clients included, was handed the
    whole arena: tenant A read tenant B's chunks in its own mapping."""
    assert chaos["cross_tenant_reads_api"] == 0, chaos["cross_samples"]
    assert chaos["mapped_scans"] >= 10 and chaos["mapped_scan_own_pages"] > 0, (
        "the memory scan saw nothing at all: it would not see another tenant's pages either"
    )
    assert chaos["cross_tenant_mapped_pages"] == 0


def test_new_sessions_get_in_under_attack(chaos) -> None:
    """While 1,100 unauthenticated connections (re-opened as the daemon closes them),
    oversized lookups and slowloris requests hit a node, a tenant's new sessions (connect,
    hello, ping) all get in, each within a second.

    Regression: on the old code 1,030 idle connections locked every engine out; later, with
    the flood re-opening what the daemon closed, new sessions took 1.4-10 s (some failed with
    ``deadline``): the accept queue stayed full behind a loop that built a transport for each
    flood connection and shared its GIL and CPU with the HTTP plane's parsing."""
    abuse = event(chaos, "abuse")
    assert abuse["flood"].get("control_opened", 0) >= 1000, abuse
    assert chaos["sessions_refused_to_legit_clients"] == 0, chaos["sessions_refused_by_kind"]
    assert chaos["legit_sessions_under_abuse"] >= 5, chaos["legit_sessions_under_abuse"]
    assert chaos["legit_session_max_s_under_abuse"] <= 1.0, chaos["legit_session_max_s_under_abuse"]


def test_control_pings_stay_fast_under_attack(chaos) -> None:
    """Regression: on the old code one lookup of a million bad ids stalled the control
    socket for 13 s; later, parsed in the daemon's threads, a stream of them kept control
    pings at p99 126-295 ms (the GIL). The bound is 50 ms, or three times what the host
    itself gives where it is that slow: the quiet p99, or the other node's p99 in the same
    attack windows (same load, no attack; seen: 35 ms quiet while the suite's other worker ran
    an engine, and 56 ms under attack against 12 ms quiet on a 2-core CI host)."""
    assert chaos["ping_samples_under_abuse"] >= 50
    assert chaos["ping_samples_beside_abuse"] >= 50
    bound = max(50.0, 3 * chaos["ping_p99_ms_quiet"], 3 * chaos["ping_p99_ms_beside_abuse"])
    assert chaos["ping_p99_ms_under_abuse"] <= bound, (
        chaos["ping_p99_ms_under_abuse"],
        chaos["ping_p99_ms_quiet"],
        chaos["ping_p99_ms_beside_abuse"],
        bound,
    )


def test_kill_9_and_restart_keep_what_reached_ssd(chaos) -> None:
    kill = event(chaos, "kill9")
    assert kill["ok"], kill
    assert chaos["kills_survived"] == chaos["kills_total"] >= 1


def test_a_full_disk_degrades_and_recovers_without_loss(chaos) -> None:
    """Regression: on the old code a full disk turned puts into internal errors, leaked the
    SSD's used_bytes and evicted what it held."""
    fill = event(chaos, "disk_fill")
    if fill.get("skipped"):
        pytest.skip(fill["skipped"])
    assert fill["degraded_seen"] and fill["recovered_s"] is not None, fill
    assert fill["ok"], fill
    assert chaos["enospc_rounds_survived"] == chaos["enospc_rounds_total"] >= 1


def test_sigstop_and_redis_loss_are_ridden_out(chaos) -> None:
    assert event(chaos, "sigstop")["ok"]
    redis = event(chaos, "redis_restart")
    assert redis["ok"], redis  # a chunk put afterwards shows in the other node's lookup


def test_clients_only_ever_see_typed_errors(chaos) -> None:
    assert chaos["client_internal_errors"] == 0, chaos["client_errors"]
    assert chaos["worker_crashes"] == []


def test_nothing_leaks_once_the_clients_are_gone(chaos) -> None:
    """Sessions, leases (pins, reservations, quarantined pages) and descriptors come back to
    an idle daemon's once every client process ended."""
    assert chaos["sessions_at_end"] == 0
    assert chaos["leaked_leases"] == 0
    assert chaos["memory_bytes_held_after_evict_all"] == 0
    assert chaos["leaked_fds"] <= 4, (chaos["fd_delta_by_node"], chaos["notes"])


def test_daemon_memory_stays_bounded(chaos) -> None:
    """Regression: on the old code 100 connections buffering 8 MiB before hello took a
    daemon from 66 MB to 872 MB, and a 3 M-id lookup took 3.7 GB."""
    assert chaos["rss_peak_mb"] <= 512, chaos["rss_peak_mb"]
