"""``kvfabric bench``: a real benchmark's JSON, plot and summary; and, with stand-in
benchmark scripts, every verdict's exit status (met 0, missed 1, failed 3) and report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PNG = b"\x89PNG\r\n\x1a\n"


def bench(*argv: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    return subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "bench", *argv],
        cwd=cwd,
        env={**env, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_cheapest_real_benchmark_leaves_json_plot_and_summary(tmp_path: Path) -> None:
    """store_bench --quick: the cheapest benchmark (about 45 s on a loaded 2-core host; the
    others start daemons or engines). On a busy machine it may miss a target: exit 1, and the
    summary says which; never a failure."""
    out = tmp_path / "results"
    done = bench("--only", "store", "--quick", "--out", str(out))
    assert done.returncode in (0, 1), done.stderr[-3000:]
    figures = json.loads((out / "store_bench.json").read_text())
    assert figures["quick"] is True and figures["targets"]["dram_put_vs_memcpy"][0] == ">="
    assert (out / "store_bench.png").read_bytes().startswith(PNG)
    assert "dram_put_vs_memcpy" in (out / "store_bench.log").read_text()  # its own table
    summary = json.loads((out / "summary.json").read_text())
    (entry,) = summary["benchmarks"]
    assert entry["status"] == ("met" if done.returncode == 0 else "missed")
    assert summary["all_targets_met"] is figures["all_targets_met"] is (done.returncode == 0)
    assert {t["figure"] for t in entry["targets"]} == set(figures["targets_met"])
    for text in (done.stdout, (out / "summary.txt").read_text()):
        assert "store_bench" in text and "hash_mtokens_s_from_list" in text and ">= 70" in text


# Stand-in benchmarks: the runner's JSON object (benchmarks/_runner.py) without measuring.
FIGURES = """\
import json, sys
met = {met!r}
print("measuring", file=sys.stderr)
print(json.dumps({{
    "ops_per_s": 2000.0 if met else 10.0, "p99_us": 10.0, "corrupt_reads": 0,
    "targets": {{"ops_per_s": [">=", 1000.0], "p99_us": ["<=", 50.0], "corrupt_reads": ["<=", 0]}},
    "targets_met": {{"ops_per_s": met, "p99_us": True, "corrupt_reads": True}},
    "all_targets_met": met, "quick": "--quick" in sys.argv,
}}))
sys.exit(0 if met else 1)
"""
CRASH = """\
import sys
print("RuntimeError: the engine did not start", file=sys.stderr)
sys.exit(3)
"""


def stand_ins(directory: Path, **scripts: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        (directory / f"{name}.py").write_text(textwrap.dedent(text))
    (directory / "_helper.py").write_text("raise SystemExit('not a benchmark')\n")
    return directory


@pytest.mark.parametrize(("met", "code"), [(True, 0), (False, 1)])
def test_met_and_missed_targets_set_the_exit_status(tmp_path: Path, met: bool, code: int) -> None:
    scripts = stand_ins(tmp_path / "benchmarks", fake_bench=FIGURES.format(met=met))
    out = tmp_path / "out"
    done = bench("--benchmarks-dir", str(scripts), "--quick", "--out", str(out))
    assert done.returncode == code, done.stderr
    assert json.loads((out / "fake_bench.json").read_text())["quick"] is True
    assert (out / "fake_bench.png").read_bytes().startswith(PNG)
    (entry,) = json.loads((out / "summary.json").read_text())["benchmarks"]
    assert entry["status"] == ("met" if met else "missed")
    assert ("MISSED" in done.stdout) is not met and "ops_per_s" in done.stdout


def test_a_failing_benchmark_fails_the_run_and_is_named(tmp_path: Path) -> None:
    """Negative control: a benchmark that exits 3 without JSON makes bench exit 3 and say which
    (stderr, the table, summary.json); the others still run and report."""
    scripts = stand_ins(
        tmp_path / "benchmarks", a_crash_bench=CRASH, b_fine_bench=FIGURES.format(met=True)
    )
    out = tmp_path / "out"
    done = bench("--benchmarks-dir", str(scripts), "--out", str(out))
    assert done.returncode == 3, done.stderr
    assert "a_crash_bench failed: exit 3, no JSON object on stdout" in done.stderr
    assert "FAILED" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == ["a_crash_bench"] and summary["all_targets_met"] is False
    assert "the engine did not start" in (out / "a_crash_bench.log").read_text()
    assert not (out / "a_crash_bench.png").exists()
    assert (out / "b_fine_bench.json").exists() and (out / "b_fine_bench.png").exists()


def test_a_benchmark_past_its_timeout_is_stopped_and_failed(tmp_path: Path) -> None:
    scripts = stand_ins(tmp_path / "benchmarks", slow_bench="import time\ntime.sleep(120)\n")
    out = tmp_path / "out"
    done = bench("--benchmarks-dir", str(scripts), "--timeout", "1", "--out", str(out), timeout=60)
    assert done.returncode == 3
    assert "slow_bench failed: timed out after 1 s" in done.stderr


def test_names_and_unknown_names(tmp_path: Path) -> None:
    scripts = stand_ins(tmp_path / "benchmarks", fake_bench=FIGURES.format(met=True))
    listed = bench("--benchmarks-dir", str(scripts), "--list")
    assert listed.returncode == 0 and listed.stdout.split() == ["fake_bench"]  # no _helper
    unknown = bench("--benchmarks-dir", str(scripts), "--only", "nope", "--out", str(tmp_path))
    assert unknown.returncode == 2 and "nope" in unknown.stderr
    # the source tree's benchmarks are found from the checkout, whatever the directory
    found = bench("--list", cwd=tmp_path)
    assert found.returncode == 0 and "store_bench" in found.stdout.split()
