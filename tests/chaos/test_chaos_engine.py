"""The chaos suite's engine part, CI-sized: a vLLM CPU engine with KVFabricConnector on
node-b of the chaos harness while node-b is killed (-9) and restarted twice, stopped and
continued, has its disk filled and freed and its Redis restarted empty, and while the
engine itself is SIGSTOPped and continued; every output is compared with the same engine's
output without the connector (``tests/support/chaos_engine.py`` says what runs and why
float32 makes "identical" bit for bit).

One run serves every test of this module. None passes vacuously: the fabric must have
served tokens (after a restart too), requests must have been in flight during the daemon's
faults and the engine must have been stopped; and the negative controls show the comparison
fails on a changed token or a logprob one ulp off, and that the model's outputs depend on
the KV past the shared prefix (a wrong chunk loaded would change them).
"""

from __future__ import annotations

import dataclasses
import math
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
from chaos_engine import differences, load_results
from chaos_harness import ENGINE_CI, run

pytestmark = pytest.mark.timeout(1800)  # the module's one run counts against its first test


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(ENGINE_CI, Path(tmp_path_factory.mktemp("chaos-engine")))


def test_engine_outputs_equal_its_no_connector_outputs_through_the_faults(chaos) -> None:
    assert chaos["engine_requests"] >= 30, chaos["engine_requests"]
    assert chaos["engine_outputs_identical"] is True, chaos["engine_differing_samples"]
    assert chaos["engine_max_logprob_diff"] == 0.0


def test_the_faults_hit_the_engine_while_it_served(chaos) -> None:
    kinds = [(e["kind"], e["node"]) for e in chaos["events"]]
    assert kinds.count(("kill9", "node-b")) == 2 and ("sigstop", "node-b") in kinds, kinds
    assert chaos["engine_requests_during_daemon_faults"] >= 3, chaos["events"]
    assert chaos["engine_stops"] >= 1


def test_the_fabric_served_the_engine_before_and_after_restarts(chaos) -> None:
    """With vLLM's own prefix cache off, every cached token was loaded from the fabric.
    (Requests around a kill find less: the daemon's DRAM is gone, and the connector stays
    away from a daemon that refused it for a couple of seconds.)"""
    assert chaos["engine_fabric_hit_tokens"] > 0
    assert chaos["engine_requests_with_hits"] >= 3
    assert chaos["engine_hit_requests_after_daemon_restart"] >= 1


def test_a_failing_daemon_costs_no_request(chaos) -> None:
    """``kv_load_failure_policy: recompute``: what the connector cannot load (daemon killed,
    stopped, out of disk) is computed; no request fails."""
    assert chaos["engine_requests_failed"] == 0, chaos["engine_failure_samples"]


def test_the_harness_invariants_hold_with_the_engine(chaos) -> None:
    assert chaos["corrupt_reads_other"] == 0, chaos["corrupt_samples"]
    assert chaos["lost_acked_ssd_objects"] == 0
    assert chaos["kills_survived"] == chaos["kills_total"] == 2
    assert chaos["sessions_at_end"] == 0 and chaos["leaked_leases"] == 0
    assert chaos["client_internal_errors"] == 0, chaos["client_errors"]


def test_negative_control_the_comparison_sees_a_changed_output(chaos) -> None:
    reference, results = load_results(Path(chaos["workdir"]))
    assert differences(reference, results) == []
    index = next(r.index for r in results if r.completion is not None)
    want = reference[index]

    changed_token = list(reference)
    changed_token[index] = dataclasses.replace(
        want, token_ids=(want.token_ids[0] + 1, *want.token_ids[1:])
    )
    assert {d["index"] for d in differences(changed_token, results)} == {index}

    first = dict(want.logprobs[0])
    token = next(iter(first))
    first[token] = math.nextafter(first[token], 0.0)  # one ulp: rounding, not a wrong token
    one_ulp = list(reference)
    one_ulp[index] = dataclasses.replace(want, logprobs=(first, *want.logprobs[1:]))
    assert {d["index"] for d in differences(one_ulp, results)} == {index}


def test_negative_control_outputs_depend_on_the_kv_past_the_shared_prefix(chaos) -> None:
    """Prompts that share a prefix generate different tokens: KV of the wrong suffix (or a
    sibling's chunk) loaded would change an output, so the comparison would see it."""
    reference, _ = load_results(Path(chaos["workdir"]))
    suffixes = ENGINE_CI.engine.suffixes if ENGINE_CI.engine else 0
    groups = [reference[i : i + suffixes] for i in range(0, len(reference), suffixes)]
    for group in groups:
        for a, b in combinations(group, 2):
            assert a.token_ids != b.token_ids
    # no near-tie that float32 rounding (~1e-6 on these logprobs) could flip
    assert chaos["engine_reference_min_margin"] > 1e-4
