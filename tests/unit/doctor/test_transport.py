"""NIXL / UCX: the real probe on this machine, and which transport the daemon ends up with
for each config (judged on probe values)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvfabric.config import DaemonConfig, load_config
from kvfabric.doctor.result import Severity
from kvfabric.doctor.transport import NixlProbe, check_transport, probe_nixl

WORKS = NixlProbe(
    module="nixl_cu12._api",
    version="1.5.1",
    ucx_version="1.23.0",
    resources=("self/memory", "tcp/lo", "cma/memory"),
)
MISSING = NixlProbe(import_error="nixl: ModuleNotFoundError; nixl_cu12: ModuleNotFoundError")
REDIS = ("cluster.index=redis", "cluster.redis_url=redis://127.0.0.1:1/0", "tcp.port=0")


def _config(tmp_path: Path, *settings: str) -> DaemonConfig:
    return load_config(env={}, overrides=[f"store.data_dir={tmp_path}", *settings])


def test_the_probe_agrees_with_what_imports_here() -> None:
    found = probe_nixl()
    assert not found.failure, found
    installed = any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12"))
    assert bool(found.module) == installed
    if installed:
        assert found.module in ("nixl._api", "nixl_cu12._api") and found.version
        assert found.usable, found.agent_error
        # UCX always has its loopback transports, unless UCX_TLS narrows them away
        assert found.ucx_version and found.resources, found.ucx_error
    else:
        assert not found.usable and "does not import" in found.reason


def test_nixl_configured_but_missing_is_an_error(tmp_path: Path) -> None:
    result = check_transport(_config(tmp_path, *REDIS, "cluster.transport=nixl"), MISSING)
    assert result.severity is Severity.ERROR
    assert "will not start" in result.message and "nixl-cu12" in result.fix


def test_auto_without_nixl_uses_the_socket_backend(tmp_path: Path) -> None:
    result = check_transport(_config(tmp_path, *REDIS), MISSING)
    assert result.severity is Severity.INFO and "socket backend" in result.message


def test_working_nixl_lists_ucx_transports_and_says_when_there_is_no_rdma(tmp_path: Path) -> None:
    result = check_transport(_config(tmp_path, *REDIS), WORKS)
    assert result.severity is Severity.OK
    assert "tcp/lo" in result.message and "no RDMA device" in result.message
    rdma = NixlProbe(**{**WORKS.__dict__, "resources": ("rc_mlx5/mlx5_0:1", "tcp/lo")})
    assert "no RDMA" not in check_transport(_config(tmp_path, *REDIS), rdma).message


def test_the_embedded_index_uses_no_transport(tmp_path: Path) -> None:
    for found in (WORKS, MISSING):
        result = check_transport(_config(tmp_path), found)
        assert result.severity is Severity.INFO and "unused" in result.message


def test_an_agent_that_cannot_start_is_not_usable(tmp_path: Path) -> None:
    broken = NixlProbe(module="nixl._api", version="1.5.1", agent_error="RuntimeError: no UCX")
    result = check_transport(_config(tmp_path, *REDIS, "cluster.transport=nixl"), broken)
    assert result.severity is Severity.ERROR and "no UCX" in result.message


def test_the_probe_tries_the_modules_the_transport_imports_in_the_same_order() -> None:
    """The probe runs in a child that loads only the standard library, so it keeps its own
    list: it must stay the transport's (kvfabric.transport.nixl_module)."""
    from kvfabric.doctor import nixl_probe
    from kvfabric.transport import nixl_module

    assert tuple(module for module, _ in nixl_probe.MODULES) == nixl_module.CANDIDATES
