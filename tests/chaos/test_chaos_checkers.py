"""Negative controls of the chaos suite: its checkers can fail.

The same harness as ``test_chaos.py``, without faults, with two things it must flag:

* a chunk of tenant a that the admin reserves and writes straight into the arena pages
  with one byte flipped in its last layer, then acknowledges like any other: the readers'
  and the final sweep's end-to-end check must count it as a corrupt read (and nothing else);
* a reader holding the admin token, which may read every tenant: the cross-tenant checks
  must see it read tenant b's chunks through the API and find them in its mapped arenas.

If either checker were blind, ``test_chaos.py`` would pass on a daemon that serves wrong
bytes or leaks tenants' memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chaos_harness import NEGATIVE, run

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def controls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(NEGATIVE, Path(tmp_path_factory.mktemp("chaos-controls")))


def test_a_planted_corrupt_chunk_is_a_corrupt_read(controls) -> None:
    planted = controls["planted_key"]
    assert planted is not None
    flagged = {c["key"] for c in controls["corrupt_samples"]}
    assert flagged == {planted}, controls["corrupt_samples"]
    assert controls["corrupt_reads"] >= 1 and controls["planted_corrupt_detected"] >= 1
    assert controls["final_sweep"].get("corrupt") == 1, controls["final_sweep"]
    assert controls["corrupt_reads_other"] == 0
    assert controls["verified_reads"] > 50  # everything else read back fine


def test_an_admin_reader_is_flagged_as_reading_another_tenant(controls) -> None:
    readers = {c["worker"] for c in controls["cross_samples"]}
    assert readers == {"reader-admin"}, controls["cross_samples"]
    assert controls["cross_tenant_reads_api"] >= 1
    assert all(
        c["how"] == "api_other_ns" and c["their_bytes"] for c in controls["cross_samples"]
    ), controls["cross_samples"]
    assert controls["cross_tenant_mapped_pages"] >= 1
