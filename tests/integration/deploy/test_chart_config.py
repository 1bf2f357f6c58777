"""The daemon config the chart renders (its ConfigMap) read by kvfabric itself: the config
loader (``kvfabric.config.load_config``, with the environment the DaemonSet gives the pod)
and ``kvfabric serve --print-config``, which also runs serve's start-up checks (credentials,
the bind rule, what the Redis index needs). Each values file of the chart, and controls that
the loader refuses what the chart's schema lets through."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.config import DaemonConfig, load_config
from kvfabric.errors import ConfigError
from kvfabric.store.codec import FORMATS
from kvfabric.store.config import HUGE_PAGES, TierConfig
from kvfabric.tiers.base import TierKind

CHART = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "kvfabric"
VALUES_FILES = [None, *sorted(CHART.glob("examples/*.yaml")), *sorted(CHART.glob("ci/*.yaml"))]
NODE = "node-a"
# A non-loopback stand-in for the pod IP (TEST-NET-1): the config only names it, nothing
# binds or connects to it (--print-config does not probe ports).
POD_IP = "192.0.2.10"
# What the Secrets the chart refers to would hold
SECRETS = {("kvfabric-redis", "redis-url"): "redis://:password@redis.kvfabric.svc:6379/0"}


def values_id(path: Path | None) -> str:
    return "defaults" if path is None else f"{path.parent.name}/{path.name}"


def rendered(chart: Any, manifest: Any, values: Path | None) -> tuple[str, dict]:
    """(kvfabric.yaml of the ConfigMap, the DaemonSet)."""
    docs = chart.render(*([values] if values else []))
    config = manifest(docs, "ConfigMap", "kvfabric-config")["data"]["kvfabric.yaml"]
    return config, manifest(docs, "DaemonSet")


def kvfabric_container(daemonset: dict) -> dict:
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return container


def pod_environment(daemonset: dict) -> dict[str, str]:
    """The container's environment as the kubelet would set it on node NODE."""
    out: dict[str, str] = {}
    for var in kvfabric_container(daemonset)["env"]:
        if "value" in var:
            out[var["name"]] = var["value"].replace("$(POD_IP)", POD_IP)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            out[var["name"]] = {"spec.nodeName": NODE, "status.podIP": POD_IP}[field]
        else:
            ref = source["secretKeyRef"]
            out[var["name"]] = SECRETS[(ref["name"], ref["key"])]
    return out


def mount_of(daemonset: dict, volume: str) -> Path:
    (path,) = [
        m["mountPath"] for m in kvfabric_container(daemonset)["volumeMounts"] if m["name"] == volume
    ]
    return Path(path)


def secret_item(daemonset: dict, volume: str) -> str:
    (spec,) = [v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == volume]
    (item,) = spec["secret"]["items"]
    return str(item["path"])


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_rendered_config_loads_and_matches_the_pod(
    chart: Any, manifest: Any, values: Path | None, tmp_path: Path
) -> None:
    """Would have caught a ConfigMap key the daemon does not know (it exits 2 on start), a
    config that needs a setting the pod does not provide, or one whose paths and ports are
    not where the DaemonSet mounts and exposes them."""
    text, daemonset = rendered(chart, manifest, values)
    path = tmp_path / "kvfabric.yaml"
    path.write_text(text)
    config = load_config(path, env=pod_environment(daemonset))

    assert config.node_id == NODE
    assert Path(config.socket_path).parent == mount_of(daemonset, "socket-dir")
    assert Path(config.store.data_dir) == mount_of(daemonset, "data")
    assert config.auth.token_file == str(
        mount_of(daemonset, "token") / secret_item(daemonset, "token")
    )
    ports = {p["name"]: p["containerPort"] for p in kvfabric_container(daemonset)["ports"]}
    assert config.http.port == ports["http"] and config.http.host == "0.0.0.0"
    values_tiers = (yaml.safe_load(values.read_text()) if values else {}).get("tiers")
    if values_tiers:
        assert [t.kind.value for t in config.store.tiers] == [t["kind"] for t in values_tiers]
    if config.cluster.index == "redis":
        assert (config.tcp.host, config.tcp.port) == (POD_IP, ports["control"])
        assert config.cluster.redis_url
        assert config.cluster.secret_file == str(
            mount_of(daemonset, "cluster-secret") / secret_item(daemonset, "cluster-secret")
        )
    else:
        assert config.tcp.port is None and "control" not in ports


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_rendered_config_passes_serve_print_config(
    chart: Any, manifest: Any, values: Path | None, tmp_path: Path
) -> None:
    """`kvfabric serve --config FILE --print-config` on the rendered config, in the pod's
    environment: it must exit 0, i.e. serve's checks pass (the token and cluster secret read,
    the bind rule met on the pod IP, a TCP endpoint for the Redis index). The files and
    directories the pod mounts are redirected here; capacities are for real nodes, so
    allow_overcommit, and no huge pages are reserved on this machine."""
    text, daemonset = rendered(chart, manifest, values)
    path = tmp_path / "kvfabric.yaml"
    path.write_text(text)
    loaded = yaml.safe_load(text)
    (tmp_path / "token").write_text("a" * 64)
    (tmp_path / "secret").write_text("s" * 64)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    env.update(pod_environment(daemonset))
    env.update(
        KVFABRIC_AUTH__TOKEN_FILE=str(tmp_path / "token"),
        KVFABRIC_STORE__DATA_DIR=str(tmp_path / "data"),
        KVFABRIC_SOCKET_PATH=str(tmp_path / "run" / "kvfabric.sock"),
        KVFABRIC_STORE__ALLOW_OVERCOMMIT="true",
    )
    if loaded.get("cluster", {}).get("index") == "redis":
        env["KVFABRIC_CLUSTER__SECRET_FILE"] = str(tmp_path / "secret")
    for tier in loaded["store"]["tiers"]:
        if tier.get("huge_pages") == "on":
            name = tier.get("name", tier["kind"]).upper()
            # quoted: a bare off is YAML's false, which huge_pages refuses
            env[f"KVFABRIC_STORE__TIERS__{name}__HUGE_PAGES"] = '"off"'
    result = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "serve", "--config", str(path), "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    effective = yaml.safe_load(result.stdout)
    assert effective["node_id"] == NODE
    assert effective["http"]["port"] == loaded["http"]["port"]
    # (--print-config leaves the cluster section out; the loader test above checks it)
    if "host" in loaded["tcp"]:
        assert effective["tcp"] == {"host": POD_IP, "port": loaded["tcp"]["port"]}
    else:
        assert effective["tcp"]["port"] is None


def test_loader_refuses_what_the_values_schema_lets_through(
    chart: Any, manifest: Any, tmp_path: Path
) -> None:
    """Negative controls: `config` is free-form below its sections, so helm renders these;
    kvfabric's loader is what refuses them, which is why these tests run it."""
    path = tmp_path / "kvfabric.yaml"
    for limits, says in (
        ({"max_sessions": 0}, "limits.max_sessions: must be a positive integer"),
        ({"bogus_limit": 1}, "limits.bogus_limit: unknown key"),
    ):
        docs = chart.render({"config": {"limits": limits}})
        path.write_text(manifest(docs, "ConfigMap", "kvfabric-config")["data"]["kvfabric.yaml"])
        with pytest.raises(ConfigError, match=says):
            load_config(path, env={"KVFABRIC_NODE_ID": NODE})
    # the cluster example takes its Redis URL from a Secret: without it the config is incomplete
    text, _ = rendered(chart, manifest, CHART / "examples" / "cluster.yaml")
    path.write_text(text)
    with pytest.raises(ConfigError, match="cluster.redis_url"):
        load_config(path, env={"KVFABRIC_NODE_ID": NODE, "KVFABRIC_TCP__HOST": POD_IP})


def test_values_schema_follows_the_daemon_config() -> None:
    """values.schema.json repeats what the daemon's config takes (the sections `config` may
    hold, a tier's keys and choices): a section or tier key added to kvfabric must be added
    there too, or the chart refuses it (or lets a removed one through to the daemon)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    sections = schema["properties"]["config"]["propertyNames"]["enum"]
    assert sorted(sections) == sorted(f.name for f in dataclasses.fields(DaemonConfig))
    tier = schema["definitions"]["tier"]["properties"]
    # the daemon refuses device tiers (CUDA IPC export is not supported yet)
    assert sorted(tier) == sorted(
        f.name for f in dataclasses.fields(TierConfig) if f.name != "device"
    )
    assert sorted(tier["kind"]["enum"]) == sorted(
        k.value for k in TierKind if k is not TierKind.DEVICE
    )
    assert sorted(tier["huge_pages"]["enum"]) == sorted(HUGE_PAGES)
    assert sorted(tier["format"]["enum"]) == sorted(FORMATS)
