"""The plain table and the --json document: every finding, its fix, the worst severity and
the exit code it maps to."""

from __future__ import annotations

import json

from kvfabric.doctor.report import as_json, render_table
from kvfabric.doctor.result import CheckResult, Severity

RESULTS = [
    CheckResult("memory.shm", Severity.OK, "/dev/shm 8.0 GiB, 8.0 GiB free"),
    CheckResult(
        "memory.thp",
        Severity.WARN,
        "arenas of dram get 4 KiB pages (shmem_enabled=never, enabled=madvise): copies into "
        "and out of them run at about half the speed of huge-page memory",
        "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled",
    ),
    CheckResult("limits.nofile", Severity.ERROR, "open files: soft limit 1024", "ulimit -n 65536"),
]


def test_the_table_has_a_row_per_check_its_fixes_and_the_exit_code() -> None:
    text = render_table(RESULTS, title="kvfabric doctor: node n1", width=100)
    lines = text.splitlines()
    assert lines[0] == "kvfabric doctor: node n1"
    assert lines[1].split() == ["SEVERITY", "CHECK", "FINDING"]
    assert any(line.startswith("warn      memory.thp") for line in lines)
    assert any(line.startswith("error     limits.nofile") for line in lines)
    assert "fix: ulimit -n 65536" in text
    assert "fix: echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled" in text
    assert all(len(line) <= 100 for line in lines)
    assert lines[-1] == "3 checks: 1 ok, 1 warn, 1 error; worst error (exit 2)"


def test_the_json_document_names_the_worst_severity_and_exit_code() -> None:
    document = json.loads(json.dumps(as_json(RESULTS, node_id="n1", config="c.yaml")))
    assert document["worst"] == "error"
    assert document["exit_code"] == 2
    assert document["counts"] == {"ok": 1, "info": 0, "warn": 1, "error": 1}
    assert [c["name"] for c in document["checks"]] == [r.name for r in RESULTS]
    assert document["checks"][1]["fix"].startswith("echo advise")
    assert (document["node_id"], document["config"]) == ("n1", "c.yaml")


def test_an_all_ok_run_exits_zero() -> None:
    ok = [RESULTS[0], CheckResult("index.redis", Severity.INFO, "embedded")]
    assert as_json(ok)["exit_code"] == 0
    assert render_table(ok).splitlines()[-1].endswith("worst info (exit 0)")
