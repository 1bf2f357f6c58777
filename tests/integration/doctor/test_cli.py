"""``kvfabric doctor`` as a user runs it: a subprocess on the default config, its JSON and
its exit code; the table; a config that does not load; --help stays light."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvfabric.doctor.result import EXIT_CODES, Severity

RANK = {"ok": 0, "info": 1, "warn": 2, "error": 3}
NAMES = (
    "memory.shm",
    "memory.memfd",
    "memory.hugetlb",
    "memory.thp",
    "memory.capacity",
    "cpu.idle",
    "limits.nofile",
    "limits.memlock",
    "disk.capacity",
    "disk.speed",
    "index.redis",
    "transport.nixl",
    "places.socket_dir",
    "places.socket",
    "places.http_port",
    "places.tcp_port",
)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}


def _doctor(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "doctor", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=cwd,
        check=False,
    )


def test_json_on_the_default_config_and_the_exit_code_of_its_worst(tmp_path: Path) -> None:
    done = _doctor(tmp_path, "--json")
    document = json.loads(done.stdout)  # stdout is the one object: nothing else printed there
    checks = document["checks"]
    assert {c["name"] for c in checks} >= set(NAMES)
    assert all(c["severity"] in RANK and c["message"] for c in checks)
    worst = max((c["severity"] for c in checks), key=RANK.__getitem__)
    assert document["worst"] == worst
    assert done.returncode == document["exit_code"] == EXIT_CODES[Severity(worst)], done.stderr
    assert not any(c["message"].startswith("the check itself failed") for c in checks)
    # the speed test ran in ./kvfabric-data/ssd and took its directories with it
    assert list(tmp_path.iterdir()) == []


def test_the_table_and_its_exit_code(tmp_path: Path) -> None:
    done = _doctor(tmp_path, "--ssd-test-size", "4MiB")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("kvfabric doctor: node ")
    assert lines[1].split() == ["SEVERITY", "CHECK", "FINDING"]
    for name in NAMES:
        assert any(f"  {name} " in line for line in lines), name
    assert lines[-1].endswith(f"(exit {done.returncode})")


def test_a_config_that_does_not_load_is_an_error_finding(tmp_path: Path) -> None:
    done = _doctor(tmp_path, "--json", "--set", "store.tiers.dram.capacity=lots")
    document = json.loads(done.stdout)
    assert done.returncode == 2
    [finding] = document["checks"]
    assert finding["name"] == "config" and finding["severity"] == "error"
    assert "store.tiers" in finding["message"] and "--print-config" in finding["fix"]


def test_the_config_flags_are_serves(tmp_path: Path) -> None:
    """A tier larger than the machine, through --set, is the error; exit 2."""
    done = _doctor(
        tmp_path, "--json", "--ssd-test-size", "0", "--set", "store.tiers.dram.capacity=64TiB"
    )
    found = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert found["memory.capacity"]["severity"] == "error"
    assert done.returncode == 2


def test_doctor_help_loads_no_heavy_module() -> None:
    code = (
        "import sys\n"
        "from kvfabric.cli import main\n"
        "try:\n"
        "    main(['doctor', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(','.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env()
    )
    modules = set(done.stdout.strip().splitlines()[-1].split(","))
    heavy = ("numpy", "pydantic", "redis", "yaml", "kvfabric.doctor", "kvfabric.config")
    assert not [m for m in modules if m.split(".")[0] in heavy or m.startswith(heavy)]
