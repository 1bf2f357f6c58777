"""The deployment files in daemons/ parse, agree with each other and start the real CLI."""

from __future__ import annotations

import configparser
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.config import load_config

DAEMONS = Path(__file__).resolve().parents[2] / "daemons"
KUBE = DAEMONS / "kubernetes"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d is not None]


def _daemonset() -> dict[str, Any]:
    (daemonset,) = _docs("daemonset.yaml")
    return daemonset


def _container() -> dict[str, Any]:
    (container,) = _daemonset()["spec"]["template"]["spec"]["containers"]
    return container


def _serve_argv() -> list[str]:
    """The ``kvfabric serve ...`` argv the container runs (directly, or exec'd by sh -c)."""
    command = _container()["command"]
    if command[0] != "sh":
        return command
    return shlex.split(command[2].rsplit("exec ", 1)[1])


def _configmap_config(tmp_path: Path) -> Path:
    (configmap,) = _docs("configmap.yaml")
    path = tmp_path / "kvfabric.yaml"
    path.write_text(configmap["data"]["kvfabric.yaml"])
    return path


@pytest.mark.parametrize("name", ["daemonset.yaml", "configmap.yaml"])
def test_manifests_parse(name: str) -> None:
    docs = _docs(name)
    assert docs and all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)


def test_configmap_holds_a_config_the_daemon_loads(tmp_path: Path) -> None:
    (configmap,) = _docs("configmap.yaml")
    assert configmap["kind"] == "ConfigMap"
    config = load_config(_configmap_config(tmp_path), env={"KVFABRIC_NODE_ID": "node-1"})
    assert config.node_id == "node-1" and config.http.host == "0.0.0.0"


def test_daemonset_runs_serve_on_the_configmap(tmp_path: Path) -> None:
    daemonset = _daemonset()
    assert daemonset["kind"] == "DaemonSet"
    pod = daemonset["spec"]["template"]["spec"]
    container = _container()
    argv = _serve_argv()
    assert argv[:2] == ["kvfabric", "serve"]
    config_path = argv[argv.index("--config") + 1]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (configmap,) = _docs("configmap.yaml")
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert Path(config_path) == Path(mounts["config"]) / next(iter(configmap["data"]))
    assert pod["terminationGracePeriodSeconds"] >= 30


def test_daemonset_shares_socket_and_data_dirs_through_the_host(tmp_path: Path) -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config = load_config(_configmap_config(tmp_path), env={})
    socket_dir = str(Path(config.socket_path).parent)
    by_path = {path: name for name, path in mounts.items()}
    assert volumes[by_path[socket_dir]]["hostPath"]["path"] == socket_dir
    assert volumes[by_path[config.store.data_dir]]["hostPath"]["path"] == config.store.data_dir
    shm = volumes[by_path["/dev/shm"]] if "/dev/shm" in by_path else None
    assert pod.get("hostIPC") is True or shm["emptyDir"]["medium"] == "Memory"


def test_daemonset_probes_hit_the_configured_http_port(tmp_path: Path) -> None:
    container = _container()
    port = load_config(_configmap_config(tmp_path), env={}).http.port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        http = container[probe]["httpGet"]
        assert http["path"] == path and ports[http["port"]] == port
    assert container["resources"]["requests"]["memory"]


def test_daemonset_env_turns_telemetry_off_and_is_a_valid_config(tmp_path: Path) -> None:
    env = {e["name"]: e.get("value", "from-field") for e in _container()["env"]}
    assert env["DO_NOT_TRACK"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["LMCACHE_TRACK_USAGE"] == "false"
    # Every KVFABRIC_* variable is a setting: the daemon must accept all of them.
    load_config(_configmap_config(tmp_path), env=env)


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string((DAEMONS / "kvfabric.service").read_text())
    return unit


def test_systemd_unit() -> None:
    service = _unit()["Service"]
    assert service["Type"] == "simple" and service["KillSignal"] == "SIGTERM"
    assert "--config /etc/kvfabric/kvfabric.yaml" in service["ExecStart"]
    assert service["Restart"] == "on-failure" and int(service["TimeoutStopSec"]) >= 30
    assert service["RestartPreventExitStatus"] == "2"  # config errors
    assert service["LimitMEMLOCK"] == "infinity"
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    writable = service["ReadWritePaths"].split()
    assert f"/var/lib/{service['StateDirectory']}" in writable
    assert f"/run/{service['RuntimeDirectory']}" in writable
    assert _unit()["Install"]["WantedBy"] == "multi-user.target"


def test_entry_point_script_honours_kvfabric_python(tmp_path: Path) -> None:
    script = DAEMONS / "kvfabric-serve"
    assert script.stat().st_mode & stat.S_IXUSR
    python = tmp_path / "python"  # records that it ran, then is the real interpreter
    python.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/ran\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    env["KVFABRIC_PYTHON"] = str(python)  # also a KVFABRIC_* variable: serve must ignore it
    out = subprocess.run(
        [str(script), "--data-dir", str(tmp_path), "--print-config"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["store"]["data_dir"] == str(tmp_path)
    assert (tmp_path / "ran").read_text().split()[:3] == ["-m", "kvfabric.cli", "serve"]


def test_configmap_config_passes_the_bind_rule_with_its_token_secret_mounted(
    tmp_path: Path,
) -> None:
    """Regression: on the old manifests HTTP listened on the pod IP with auth off; the daemon
    now refuses that, so the ConfigMap turns tokens on and the DaemonSet mounts the Secret."""
    from kvfabric.config import check_binds

    config = load_config(_configmap_config(tmp_path), env={})
    assert check_binds(config) == [] and config.auth.token_file
    mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in _daemonset()["spec"]["template"]["spec"]["volumes"]}
    token_dir = str(Path(config.auth.token_file).parent)
    by_path = {path: name for name, path in mounts.items()}
    assert volumes[by_path[token_dir]]["secret"]["secretName"] == "kvfabric-token"


def test_systemd_unit_bounds_files_tasks_and_cores() -> None:
    """Regression: the issue found the unit without the limits a flood runs into."""
    service = _unit()["Service"]
    assert int(service["LimitNOFILE"]) >= 65536
    assert 1024 <= int(service["TasksMax"]) < 65536
    assert service["LimitCORE"] == "0"  # a core dump would hold tenants' KV on disk


def test_daemonset_raises_the_file_limit_or_refuses_to_start(tmp_path: Path) -> None:
    """The container's entry script sets the soft file limit to the hard one and exits 2
    (a config error: no restart loop) when that is below 65536; run it for real."""
    command = _container()["command"]
    assert command[:2] == ["sh", "-c"]
    fake = tmp_path / "kvfabric"  # stands in for the real CLI on PATH
    fake.write_text('#!/bin/sh\necho "ran $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    low = subprocess.run(
        ["sh", "-c", f"ulimit -n 4096 && {command[2]}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert low.returncode == 2 and "file limit 4096" in low.stderr
    assert "ran" not in low.stdout
