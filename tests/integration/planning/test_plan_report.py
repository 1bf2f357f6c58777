"""`kvfabric plan report` and `advise` as a user runs them: the studies' tables and real PNG
plots from the example file, and an advice that follows the mix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "configs" / "plan" / "example.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def kvfabric(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_report_writes_the_tables_and_the_plots(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = kvfabric("report", "--inputs", str(EXAMPLE), "--out", str(out))
    assert done.returncode == 0, done.stderr
    data = json.loads((out / "report.json").read_text())
    for plot in data["plots"]:
        assert (out / plot).read_bytes()[:8] == PNG
    layouts = {(r["workload"], r["layout"].split()[0]): r for r in data["mono_vs_disagg"]}
    # disaggregation keeps prefills out of the decode steps: a lower TPOT tail
    for workload in ("long-prompt", "long-output"):
        mono, disagg = layouts[workload, "monolithic"], layouts[workload, "disaggregated"]
        assert disagg["tpot_p99_s"] < mono["tpot_p99_s"]
        assert disagg["engines"] == mono["engines"]
    overlap = {(r["layers"], r["bytes_per_s"]): r["landed_fraction"] for r in data["overlap"]}
    assert overlap[32, 100e9 / 8] == 31 / 32  # the link keeps up: all but the last layer
    assert overlap[32, 10e9 / 8] < 0.5  # 10 Gb/s does not
    windows = data["rebalance"]
    first, last = windows[0], windows[-1]
    assert int(first["prefill"].split()[0]) > int(last["prefill"].split()[0])
    assert int(first["decode"].split()[0]) < int(last["decode"].split()[0])
    assert "## Tiered vs one class" in (out / "report.md").read_text()


def test_advise_names_a_composition_and_fails_on_an_unknown_workload() -> None:
    done = kvfabric("advise", "--inputs", str(EXAMPLE), "--workload", "long-output", "--json")
    assert done.returncode == 0, done.stderr
    advice = json.loads(done.stdout)
    assert advice["met"] and advice["decode_engines"] > advice["prefill_engines"]
    missing = kvfabric("advise", "--inputs", str(EXAMPLE), "--workload", "nope")
    assert missing.returncode == 2 and "no workload 'nope'" in missing.stderr
