"""RLIMIT_NOFILE and RLIMIT_MEMLOCK judged against what the daemon needs: given limits, and
this process's own in a child whose soft limit is lowered for real."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.config import DaemonConfig, load_config
from kvfabric.doctor.limits import (
    NOFILE_NEEDED,
    check_memlock,
    check_nofile,
    descriptor_floor,
)
from kvfabric.doctor.result import Severity

INF = resource.RLIM_INFINITY


def _config(tmp_path: Path, *settings: str) -> DaemonConfig:
    return load_config(env={}, overrides=[f"store.data_dir={tmp_path / 'data'}", *settings])


@pytest.mark.parametrize(
    ("limits", "severity", "fix"),
    [
        ((NOFILE_NEEDED, NOFILE_NEEDED), Severity.OK, ""),
        ((INF, INF), Severity.OK, ""),
        ((4096, INF), Severity.WARN, f"ulimit -n {NOFILE_NEEDED}"),
        ((20000, 20000), Severity.ERROR, "raise the hard limit"),
        ((1024, INF), Severity.ERROR, f"ulimit -n {NOFILE_NEEDED}"),  # below the caps
    ],
)
def test_open_file_limits(
    tmp_path: Path, limits: tuple[int, int], severity: Severity, fix: str
) -> None:
    result = check_nofile(_config(tmp_path), limits)
    assert result.severity is severity, result
    assert fix in result.fix


def test_the_caps_floor_follows_the_config(tmp_path: Path) -> None:
    small = descriptor_floor(_config(tmp_path))
    big = descriptor_floor(_config(tmp_path, "limits.max_sessions=60000"))
    assert big == small - 1024 + 60000
    result = check_nofile(_config(tmp_path, "limits.max_sessions=60000"), (20000, INF))
    assert result.severity is Severity.ERROR and "EMFILE" in result.message


def test_this_process_limit_is_read_for_real(tmp_path: Path) -> None:
    """A child lowers its own soft limit to 1024, then runs the check on itself."""
    code = (
        "import json, resource, sys\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))\n"
        "from kvfabric.config import load_config\n"
        "from kvfabric.doctor.limits import check_nofile\n"
        "r = check_nofile(load_config(env={}, overrides=[f'store.data_dir={sys.argv[1]}']))\n"
        "print(json.dumps(r.as_dict()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["severity"] == "error"
    assert found["values"]["soft"] == 1024


def test_memlock_matters_only_when_nixl_registers_the_tiers(tmp_path: Path) -> None:
    embedded = check_memlock(_config(tmp_path), nixl_usable=True, limit=64 << 10)
    assert embedded.severity is Severity.INFO and "nothing is pinned" in embedded.message
    redis = ("cluster.index=redis", "cluster.redis_url=redis://127.0.0.1:1/0", "tcp.port=0")
    socket = check_memlock(
        _config(tmp_path, *redis, "cluster.transport=socket"), nixl_usable=True, limit=64 << 10
    )
    assert socket.severity is Severity.INFO
    auto_without = check_memlock(_config(tmp_path, *redis), nixl_usable=False, limit=64 << 10)
    assert auto_without.severity is Severity.INFO and "NIXL is unavailable" in auto_without.message
    nixl = _config(tmp_path, *redis, "cluster.transport=nixl")
    low = check_memlock(nixl, nixl_usable=True, limit=64 << 10)
    assert low.severity is Severity.WARN
    assert "LimitMEMLOCK=infinity" in low.fix
    # the default DRAM tier (1 GiB) plus the 64 MiB fp8 staging arena
    assert dict(low.values)["needed"] == (1 << 30) + (64 << 20)
    assert check_memlock(nixl, nixl_usable=True, limit=INF).severity is Severity.OK
