"""The Helm chart (deploy/helm/kvfabric) rendered by the real helm: what each mode puts in the
manifests, values it must refuse (values.schema.json and the templates' own checks), and the
output against Kubernetes' schemas (kubernetes-validate) and the Prometheus Operator's CRD
schemas."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "kvfabric" / "examples"
VALUES_FILES = [None, *sorted(EXAMPLES.glob("*.yaml")), *sorted(EXAMPLES.parent.glob("ci/*.yaml"))]


def values_id(path: Path | None) -> str:
    return "defaults" if path is None else f"{path.parent.name}/{path.name}"


def container(daemonset: dict) -> dict:
    (kvfabric,) = daemonset["spec"]["template"]["spec"]["containers"]
    return kvfabric


def volumes(daemonset: dict) -> dict[str, dict]:
    return {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}


def mounts(daemonset: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container(daemonset)["volumeMounts"]}


def env(daemonset: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(daemonset)["env"]}


def daemon_config(docs: list[dict], manifest: Any) -> dict:
    return yaml.safe_load(manifest(docs, "ConfigMap", "kvfabric-config")["data"]["kvfabric.yaml"])


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_helm_lint_strict(chart: Any, values: Path | None) -> None:
    argv = [chart.helm, "lint", "--strict", str(chart.path)]
    result = subprocess.run(
        [*argv, *(["-f", str(values)] if values else [])], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_daemonset_shares_host_dirs_with_engines(chart: Any, manifest: Any) -> None:
    """Would have caught a DaemonSet whose socket or SSD directory is not the host's (engine
    pods would find no socket), or whose config points elsewhere than the mounts."""
    docs = chart.render(sets=["hostPaths.socket=/run/kvf", "hostPaths.data=/mnt/nvme0/kvf"])
    daemonset = manifest(docs, "DaemonSet")
    vols, where = volumes(daemonset), mounts(daemonset)
    assert vols["socket-dir"]["hostPath"] == {"path": "/run/kvf", "type": "DirectoryOrCreate"}
    assert vols["data"]["hostPath"] == {"path": "/mnt/nvme0/kvf", "type": "DirectoryOrCreate"}
    # the same paths inside: engine pods mount the host directory at the path the daemon uses
    assert where["socket-dir"] == "/run/kvf" and where["data"] == "/mnt/nvme0/kvf"
    config = daemon_config(docs, manifest)
    assert config["socket_path"] == "/run/kvf/kvfabric.sock"
    assert config["store"]["data_dir"] == "/mnt/nvme0/kvf"
    # the init container hands both directories to the daemon's user
    (init,) = daemonset["spec"]["template"]["spec"]["initContainers"]
    assert {m["name"] for m in init["volumeMounts"]} == {"data", "socket-dir"}
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 2000
    assert pod["securityContext"]["fsGroup"] == 2000
    assert container(daemonset)["securityContext"]["readOnlyRootFilesystem"] is True


def test_single_node_mode_has_no_cluster_parts(chart: Any, manifest: Any) -> None:
    docs = chart.render()
    config = daemon_config(docs, manifest)
    assert "cluster" not in config and config["tcp"] == {"port": None}
    daemonset = manifest(docs, "DaemonSet")
    assert "KVFABRIC_TCP__HOST" not in env(daemonset)
    assert "cluster-secret" not in volumes(daemonset)
    ingress = manifest(docs, "NetworkPolicy")["spec"]["ingress"]
    assert [rule["ports"] for rule in ingress] == [[{"port": "http", "protocol": "TCP"}]]
    # auth is on (HTTP listens on the pod IP): a chart-made token Secret, mounted
    secret = manifest(docs, "Secret", "kvfabric-token")
    assert len(secret["data"]["token"]) > 40
    assert volumes(daemonset)["token"]["secret"]["secretName"] == "kvfabric-token"
    assert config["auth"]["token_file"] == "/etc/kvfabric-secret/token"


def test_cluster_mode_renders_redis_secrets_and_network_policy(chart: Any, manifest: Any) -> None:
    """Would have caught a cluster that does not reach Redis (URL neither in the config nor
    from its Secret), a cluster secret not mounted where the config says, peers told a
    host name other pods cannot resolve, or a peer port open to every pod."""
    docs = chart.render(EXAMPLES / "cluster.yaml")
    daemonset = manifest(docs, "DaemonSet")
    variables = env(daemonset)
    assert variables["KVFABRIC_CLUSTER__REDIS_URL"] == {
        "secretKeyRef": {"name": "kvfabric-redis", "key": "redis-url"}
    }
    assert variables["KVFABRIC_TCP__HOST"] == "$(POD_IP)"
    assert variables["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    config = daemon_config(docs, manifest)
    assert config["cluster"]["index"] == "redis"
    assert "redis_url" not in config["cluster"]  # it may hold a password: the Secret has it
    assert config["cluster"]["secret_file"] == "/etc/kvfabric-cluster/cluster-secret"
    assert mounts(daemonset)["cluster-secret"] == "/etc/kvfabric-cluster"
    assert volumes(daemonset)["cluster-secret"]["secret"]["secretName"] == (
        "kvfabric-cluster-secret"
    )
    assert len(manifest(docs, "Secret", "kvfabric-cluster-secret")["data"]["cluster-secret"]) > 40
    ports = {p["name"]: p["containerPort"] for p in container(daemonset)["ports"]}
    assert (
        ports
        == {"http": 8790, "control": 8791}
        == {
            "http": config["http"]["port"],
            "control": config["tcp"]["port"],
        }
    )
    http_rule, peer_rule = manifest(docs, "NetworkPolicy")["spec"]["ingress"]
    assert http_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert peer_rule["ports"] == [
        {"port": "control", "protocol": "TCP"},
        {"port": 32768, "endPort": 60999, "protocol": "TCP"},
    ]
    assert peer_rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvfabric"}}}
    ]
    # huge pages: requested (equal requests and limits) and used by the DRAM tier
    resources = container(daemonset)["resources"]
    assert resources["limits"]["hugepages-2Mi"] == resources["requests"]["hugepages-2Mi"]
    assert config["store"]["tiers"][0]["huge_pages"] == "on"


def test_cluster_mode_with_an_inline_redis_cluster_url(chart: Any, manifest: Any) -> None:
    docs = chart.render(
        {
            "mode": "cluster",
            "cluster": {"redis": {"url": "redis+cluster://redis.kvfabric.svc:6379/0"}},
            "auth": {"existingSecret": "my-token"},
        },
        sets=["cluster.secret.existingSecret=my-cluster-secret"],
    )
    config = daemon_config(docs, manifest)
    assert config["cluster"]["redis_url"] == "redis+cluster://redis.kvfabric.svc:6379/0"
    assert "KVFABRIC_CLUSTER__REDIS_URL" not in env(manifest(docs, "DaemonSet"))
    # existing Secrets named: the chart makes none, and mounts those
    assert [d for d in docs if d["kind"] == "Secret"] == []
    daemonset_volumes = volumes(manifest(docs, "DaemonSet"))
    assert daemonset_volumes["token"]["secret"]["secretName"] == "my-token"
    assert daemonset_volumes["cluster-secret"]["secret"]["secretName"] == "my-cluster-secret"


def test_memory_tiers_stay_off_huge_pages_unless_the_pod_gets_them(
    chart: Any, manifest: Any
) -> None:
    """Would have caught `huge_pages: auto` in a pod without a hugetlb limit: the daemon sees
    the node's free huge pages, takes them, and faults when it touches them."""
    config = daemon_config(chart.render(), manifest)
    assert config["store"]["tiers"][0] == {
        "kind": "dram",
        "capacity": "16GiB",
        "prefault": True,
        "huge_pages": "off",
    }
    docs = chart.render(sets=["hugepages.enabled=true", "hugepages.amount=16Gi"])
    assert daemon_config(docs, manifest)["store"]["tiers"][0]["huge_pages"] == "on"
    resources = container(manifest(docs, "DaemonSet"))["resources"]
    assert resources["requests"]["hugepages-2Mi"] == "16Gi"


def test_monitoring_resources(chart: Any, manifest: Any) -> None:
    """The monitors present the admin token (/metrics is admin only) and label the job the
    alert rules match; the PrometheusRule carries files/kvfabric-alerts.yaml's groups."""
    docs = chart.render(
        sets=[
            "serviceMonitor.enabled=true",
            "podMonitor.enabled=true",
            "prometheusRule.enabled=true",
            "grafanaDashboard.enabled=true",
        ]
    )
    for kind, key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        (endpoint,) = manifest(docs, kind)["spec"][key]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        assert endpoint["authorization"]["credentials"] == {
            "name": "kvfabric-token",
            "key": "token",
        }
        assert {"targetLabel": "job", "replacement": "kvfabric"} in endpoint["relabelings"]
    alerts = yaml.safe_load((chart.path / "files" / "kvfabric-alerts.yaml").read_text())
    assert manifest(docs, "PrometheusRule")["spec"]["groups"] == alerts["groups"]
    dashboard = manifest(docs, "ConfigMap", "kvfabric-dashboard")
    assert json.loads(dashboard["data"]["kvfabric-dashboard.json"]) == json.loads(
        (chart.path / "files" / "kvfabric-dashboard.json").read_text()
    )
    # off by default: clusters without the Prometheus Operator have no such kinds
    kinds = {d["kind"] for d in chart.render()}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


BROKEN_VALUES = {
    "unparsable capacity": ({"tiers": [{"kind": "dram", "capacity": "lots"}]}, "capacity"),
    "zero capacity": ({"tiers": [{"kind": "ssd", "capacity": "0GiB"}]}, "capacity"),
    "misspelt tier key": ({"tiers": [{"kind": "dram", "capcity": "4GiB"}]}, "capcity"),
    "device tier": ({"tiers": [{"kind": "device", "capacity": "4GiB"}]}, "kind"),
    "no tiers": ({"tiers": []}, "tiers"),
    "cluster without Redis": ({"mode": "cluster"}, "redis"),
    "unknown mode": ({"mode": "multi"}, "mode"),
    "not a Redis URL": (
        {"mode": "cluster", "cluster": {"redis": {"url": "http://redis:6379"}}},
        "url",
    ),
    "short cluster secret": (
        {
            "mode": "cluster",
            "cluster": {"redis": {"url": "redis://r:6379/0"}, "secret": {"value": "short"}},
        },
        "value",
    ),
    "heartbeat not shorter than the lease": (
        {
            "mode": "cluster",
            "cluster": {
                "redis": {"url": "redis://r:6379/0"},
                "heartbeatSeconds": 10,
                "leaseTtlSeconds": 10,
            },
        },
        "heartbeatSeconds",
    ),
    "unknown daemon config section": ({"config": {"storage": {"x": 1}}}, "storage"),
    "relative host path": ({"hostPaths": {"data": "data", "socket": "/run/kvf"}}, "data"),
}


@pytest.mark.parametrize("values,says", BROKEN_VALUES.values(), ids=BROKEN_VALUES.keys())
def test_broken_values_are_refused(chart: Any, values: dict, says: str) -> None:
    """Negative controls: each of these would render a daemon that refuses to start (or a
    cluster that cannot form); helm must refuse them first, naming the value."""
    assert says in chart.render_error(values)


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_rendered_manifests_match_kubernetes_schemas(
    chart: Any, kube_validate: str, values: Path | None, tmp_path: Path
) -> None:
    result = chart.template(*([values] if values else []))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "manifests.yaml"
    out.write_text(result.stdout)
    for version in ("1.28.0", "1.37.0"):
        check = subprocess.run(
            [kube_validate, "--strict", "--quiet", "-k", version, str(out)],
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stdout + check.stderr


def test_schema_validator_refuses_a_broken_daemonset(
    chart: Any, kube_validate: str, manifest: Any, tmp_path: Path
) -> None:
    """Negative control: the validator does look (an unknown field, a port as a word)."""
    docs = chart.render()
    daemonset = manifest(docs, "DaemonSet")
    container(daemonset)["volumeMountz"] = container(daemonset).pop("volumeMounts")
    container(daemonset)["ports"][0]["containerPort"] = "http"
    out = tmp_path / "broken.yaml"
    out.write_text(yaml.safe_dump(daemonset))
    check = subprocess.run([kube_validate, "--strict", str(out)], capture_output=True, text=True)
    assert check.returncode != 0
    assert "daemonset/kvfabric" in check.stdout + check.stderr


VALIDATE_CRDS = """
const docs = JSON.parse(process.argv[1]);
const out = [];
for (const doc of docs) {
  const [group, version] = doc.apiVersion.split("/");
  const models = await import(
    `@kubernetes-models/prometheus-operator/${group}/${version}/${doc.kind}`);
  try { new models[doc.kind](doc).validate(); out.push("valid"); }
  catch (error) { out.push(error.message); }
}
console.log(JSON.stringify(out));
"""


def validate_crds(crd_models: Path, docs: list[dict]) -> list[str]:
    result = subprocess.run(
        ["node", "--input-type=module", "-e", VALIDATE_CRDS, json.dumps(docs)],
        capture_output=True,
        text=True,
        cwd=crd_models,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_monitoring_resources_match_the_operator_crds(
    chart: Any, crd_models: Path, manifest: Any
) -> None:
    """ServiceMonitor, PodMonitor and PrometheusRule against the Prometheus Operator's CRD
    schemas (kubernetes-validate has none for them), with a broken one as the control."""
    docs = chart.render(EXAMPLES.parent / "ci" / "all-features-values.yaml")
    custom = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert sorted(d["kind"] for d in custom) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    assert validate_crds(crd_models, custom) == ["valid"] * 3
    broken = manifest(custom, "ServiceMonitor")
    broken["spec"]["endpoints"][0]["interval"] = "every minute"
    (verdict,) = validate_crds(crd_models, [broken])
    assert "interval" in verdict
