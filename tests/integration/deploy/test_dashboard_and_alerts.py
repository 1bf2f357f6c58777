"""The operators' Grafana dashboard and Prometheus alert rules (deploy/helm/kvfabric/files/)
hold up against the real thing: promtool accepts the rules and passes their unit tests
(deploy/prometheus/kvfabric-alerts.test.yaml), every metric a panel or a rule names is on a
live daemon's /metrics, and the dashboard is well-formed Grafana JSON (a datasource and
targets per panel, unique ids, no overlapping boxes)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from cluster_nodes import cluster_node
from prometheus_client.parser import text_string_to_metric_families
from scrape import sample, scrape

from kvfabric.client import Client
from kvfabric.errors import NotFoundError
from kvfabric.hashing import chunk_hashes
from kvfabric.spec import KVSpec, Namespace

ROOT = Path(__file__).resolve().parents[3]
FILES = ROOT / "deploy" / "helm" / "kvfabric" / "files"
DASHBOARD = FILES / "kvfabric-dashboard.json"
ALERTS = FILES / "kvfabric-alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "kvfabric-alerts.test.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install -y prometheus)"
)

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
TENANT_NS = Namespace("dashboard-model", SPEC, tenant_salt="team-d")
# Series only node-to-node traffic (a cluster with a peer transport) or a fault creates; the
# families are declared on every daemon, so their names are still checked.
CLUSTER_OR_FAULT_ONLY = {
    "kvfabric_push_chunks_total",
    "kvfabric_push_bytes_total",
    "kvfabric_push_tail_seconds",
    "kvfabric_pull_chunks_total",
    "kvfabric_tier_disk_errors_total",
    "kvfabric_control_connections_closed_total",
}


# ---------------------------------------------------------------- PromQL metric names

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_OFFSET = re.compile(r"\boffset\s+-?[\w$]+", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])(?:0x[0-9a-f]+|\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)", re.IGNORECASE)
_IDENT = re.compile(r"(?<![\w$])([a-zA-Z_:][\w:]*)\s*(\()?")
_KEYWORDS = {
    "and", "or", "unless", "bool", "by", "without", "on", "ignoring",
    "group_left", "group_right", "offset", "inf", "nan",
}  # fmt: skip
# made by Prometheus itself (scrape health), never on /metrics
_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
_HISTOGRAM_SUFFIX = re.compile(r"_(?:bucket|sum|count)$")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([a-zA-Z_:][\w:]*)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: strings, label matchers, ranges, label lists
    (`by (...)` and the like), offsets, numbers, functions and keywords removed; `up` and
    other series Prometheus makes are left out."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS or name in _SYNTHETIC:
            continue  # a function or an aggregation, or not a metric
        names.add(name)
    return names


def variable_metric_names(query: str) -> set[str]:
    """A Grafana query variable: `label_values(metric{...}, label)` names one metric (its
    second argument is a label), anything else is PromQL."""
    found = _LABEL_VALUES.match(query)
    if found:
        return set() if found.group(1) in _SYNTHETIC else {found.group(1)}
    return promql_metric_names(query)


def test_the_extractor_reads_names_through_promql_syntax() -> None:
    cases = {
        'sum by (tier) (rate(a_total{tier=~"x|y", tenant!="b_total"}[5m]))\n'
        "  / ignoring(tier) group_left sum(rate(b_total[$__rate_interval]))": {
            "a_total",
            "b_total",
        },
        "histogram_quantile(0.99, sum by (op, le) (rate(h_seconds_bucket{op='get'}[5m])))": {
            "h_seconds_bucket"
        },
        'up{job="kvfabric"} == 0': set(),
        "absent(up{job='kvfabric'})": set(),
        "count(up == 0) or vector(0)": set(),
        "1e3 * max_over_time(g[5m:1m]) > 0.5 and on (instance) c_total offset 1h": {
            "g",
            "c_total",
        },
        "sum without (pod) (x:recorded:rate5m) > bool 2": {"x:recorded:rate5m"},
    }
    for expr, names in cases.items():
        assert promql_metric_names(expr) == names, expr
    assert variable_metric_names('label_values(kvfabric_node_info{n=~"$n"}, instance)') == {
        "kvfabric_node_info"
    }
    assert variable_metric_names('label_values(up{job="kvfabric"}, namespace)') == set()


# ---------------------------------------------------------------- the files


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _all_panels(panel.get("panels", []))  # a collapsed row keeps its own


def _alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard_expressions() -> dict[str, str]:
    """Where -> PromQL, for every panel target and query variable of the dashboard."""
    dashboard = _dashboard()
    out = {}
    for panel in _all_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out[f"variable {var['name']}"] = query["query"] if isinstance(query, dict) else query
    return out


def referenced_names() -> dict[str, set[str]]:
    """Metric name -> where the dashboard and the alert rules use it."""
    where: dict[str, set[str]] = {}
    for place, expr in dashboard_expressions().items():
        names = variable_metric_names(expr) if place.startswith("variable") else None
        for name in names if names is not None else promql_metric_names(expr):
            where.setdefault(name, set()).add(place)
    for rule in _alert_rules():
        for name in promql_metric_names(rule["expr"]):
            where.setdefault(name, set()).add(f"alert {rule.get('alert') or rule.get('record')}")
    return where


def overlapping(panels: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Pairs of panel ids whose gridPos boxes share any cell."""
    boxes = [(p["id"], p["gridPos"]) for p in panels]
    pairs = []
    for i, (a, pa) in enumerate(boxes):
        for b, pb in boxes[i + 1 :]:
            if (
                pa["x"] < pb["x"] + pb["w"]
                and pb["x"] < pa["x"] + pa["w"]
                and pa["y"] < pb["y"] + pb["h"]
                and pb["y"] < pa["y"] + pa["h"]
            ):
                pairs.append((a, b))
    return pairs


def test_the_dashboard_is_well_formed_grafana_json() -> None:
    dashboard = _dashboard()
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "instance", "tenant"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    panels = list(_all_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        box = panel["gridPos"]
        assert box["w"] > 0 and box["h"] > 0 and box["x"] >= 0 and box["y"] >= 0, panel["title"]
        assert box["x"] + box["w"] <= 24, f"{panel['title']} is wider than the grid"
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["targets"], f"{panel['title']} has no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"]
    assert overlapping(panels) == []


def test_the_overlap_check_sees_overlapping_panels() -> None:
    """Negative control of the grid check."""
    panels = [
        {"id": 1, "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8}},
        {"id": 2, "gridPos": {"x": 12, "y": 0, "w": 12, "h": 8}},  # beside 1: fine
        {"id": 3, "gridPos": {"x": 6, "y": 7, "w": 4, "h": 2}},  # over 1's last line
    ]
    assert overlapping(panels) == [(1, 3)]


def test_the_dashboard_covers_what_operators_asked_for() -> None:
    """Hit rate per tier, tenant and engine; occupancy; evictions and demotions; transfer
    throughput and latency; lookup latency; errors; daemons up."""
    used = referenced_names()
    exprs = "\n".join(dashboard_expressions().values())
    for by in ("tier", "tenant", "engine"):
        assert re.search(rf"sum by \({by}\) \(rate\(kvfabric_(engine_)?hit_tokens_total", exprs)
    for name in (
        "kvfabric_tier_used_bytes",
        "kvfabric_tier_capacity_bytes",
        "kvfabric_tier_evictions_total",
        "kvfabric_tier_demotions_total",
        "kvfabric_tier_in_bytes_total",
        "kvfabric_push_bytes_total",
        "kvfabric_push_tail_seconds_bucket",
        "kvfabric_store_operation_duration_seconds_bucket",
        "kvfabric_request_errors_total",
        "kvfabric_cluster_index_up",
    ):
        assert any(place.startswith("panel") for place in used[name]), name
    assert 'up{job="kvfabric"' in exprs


def test_alert_rules_have_the_shape_the_chart_and_alertmanager_need() -> None:
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"}, "the chart embeds this file as a PrometheusRule spec"
    rules = _alert_rules()
    assert {r["alert"] for r in rules} >= {
        "KVFabricDaemonDown",
        "KVFabricHitRateCollapse",
        "KVFabricSSDDiskErrors",
        "KVFabricTransferErrors",
        "KVFabricTierFull",
        "KVFabricIndexUnreachable",
    }
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
    (down,) = [r for r in rules if r["alert"] == "KVFabricDaemonDown"]
    assert down["expr"].strip() == 'up{job="kvfabric"} == 0'  # the documented job name


def test_every_alert_has_a_firing_and_a_quiet_promtool_case() -> None:
    """Each rule fires somewhere in the promtool tests and is expected quiet somewhere."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    assert tests["rule_files"] == ["../helm/kvfabric/files/kvfabric-alerts.yaml"]
    cases = [case for group in tests["tests"] for case in group["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    alerts = {r["alert"] for r in _alert_rules()}
    assert firing == alerts and quiet == alerts


# ---------------------------------------------------------------- promtool


def _promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_accepts_the_rules_as_they_are() -> None:
    done = _promtool("check", "rules", str(ALERTS.relative_to(ROOT)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in done.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    done = _promtool("test", "rules", str(ALERT_TESTS.relative_to(ROOT)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# Grafana's variables as Prometheus would get them with "All" selected
_GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$namespace": ".*",
    "$instance": ".*",
    "$tenant": ".*",
}


@needs_promtool
def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel's query (as a recording rule) once Grafana's variables are
    put in: a typo in a panel would otherwise only show as an empty graph."""
    rules = []
    for i, (place, query) in enumerate(sorted(dashboard_expressions().items())):
        if place.startswith("variable"):
            continue  # label_values(...) is Grafana's, not PromQL
        expr = query
        for variable, value in _GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"{place}: a variable this test does not know: {expr}"
        rules.append({"record": f"dashboard:panel_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = _promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


@needs_promtool
def test_promtool_fails_an_alert_that_fires_on_a_healthy_series(tmp_path: Path) -> None:
    """Negative control: the same tests against rules whose degraded threshold also matches
    healthy tiers (0) must fail, so a passing run means the expectations are checked."""
    (tmp_path / "files").mkdir()
    broken = ALERTS.read_text().replace(
        "(kvfabric_tier_degraded) == 1", "(kvfabric_tier_degraded) >= 0"
    )
    assert broken != ALERTS.read_text()
    (tmp_path / "files" / "kvfabric-alerts.yaml").write_text(broken)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "alerts.test.yaml").write_text(
        ALERT_TESTS.read_text().replace("../helm/kvfabric/files/", "../files/")
    )
    done = _promtool("test", "rules", "tests/alerts.test.yaml", cwd=tmp_path)
    assert done.returncode != 0, done.stdout
    assert "KVFabricSSDTierDegraded" in done.stdout + done.stderr


# ---------------------------------------------------------------- a live daemon


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(
        "dashboard",
        "store.tiers.dram.capacity=4MiB",
        "store.tiers.dram.page_size=16KiB",
        "store.tiers.ssd.capacity=16MiB",
        "store.quotas.team-d.ssd=50%",  # a configured tenant: kvfabric_tier_tenant_used_bytes
    )


@pytest.fixture(scope="module")
def exposition(daemon) -> str:
    """/metrics after an engine's traffic: puts, hits, a miss, reads and a failed read, so
    the labelled series (tier, tenant, engine, op, kind) exist."""
    refs = chunk_hashes(TENANT_NS, list(range(64)))
    with Client(daemon.socket, engine="vllm") as client:
        client.put_many(TENANT_NS, refs, [np.zeros(SPEC.chunk_bytes, np.uint8) for _ in refs])
        keys = [ref.key for ref in refs]
        assert client.lookup(TENANT_NS, keys=keys).matched_chunks == len(refs)
        missing = chunk_hashes(TENANT_NS, list(range(1000, 1032)))
        client.lookup(TENANT_NS, keys=[ref.key for ref in missing])
        for key in keys[:2]:
            with client.get(TENANT_NS, key) as reader:
                assert len(reader.to_bytes()) == SPEC.chunk_bytes
        with pytest.raises(NotFoundError):
            client.get(TENANT_NS, missing[0].key)
    with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def exposed_names(text: str) -> tuple[set[str], set[str]]:
    """(names a query may select: every family's series names whether or not it has a sample
    yet, names with at least one sample) from Prometheus text."""
    declared, sampled = set(), set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, ("",)):
            declared.add(family.name + suffix)
        sampled.update(s.name for s in family.samples)
    return declared, sampled


def missing_names(used: dict[str, set[str]], declared: set[str]) -> dict[str, set[str]]:
    return {name: places for name, places in used.items() if name not in declared}


def test_every_metric_the_dashboard_and_alerts_name_is_on_a_live_daemon(exposition) -> None:
    used = referenced_names()
    assert len(used) > 30 and all(name.startswith("kvfabric_") for name in used), used
    declared, sampled = exposed_names(exposition)
    assert missing_names(used, declared) == {}
    # the traffic made every other series the panels draw (a histogram by its family name)
    without_samples = {_HISTOGRAM_SUFFIX.sub("", n) for n in used if n not in sampled}
    assert without_samples <= CLUSTER_OR_FAULT_ONLY
    values = scrape_samples(exposition)
    assert values[("kvfabric_cluster_index_up", (("index", "embedded"),))] == 1
    assert values[("kvfabric_lookup_tokens_total", (("tenant", "team-d"),))] == 64 + 32
    assert values[("kvfabric_engine_hit_tokens_total", (("engine", "vllm"),))] == 64


def test_a_made_up_metric_is_flagged(exposition) -> None:
    """Negative control of the check above."""
    declared, _ = exposed_names(exposition)
    used = {
        name: {"alert Test"}
        for name in promql_metric_names(
            "sum(rate(kvfabric_made_up_total[5m])) / sum(rate(kvfabric_lookup_tokens_total[5m]))"
            " + histogram_quantile(0.9, rate(kvfabric_lookup_seconds_bucket[5m]))"
        )
    }
    assert missing_names(used, declared) == {
        "kvfabric_made_up_total": {"alert Test"},
        "kvfabric_lookup_seconds_bucket": {"alert Test"},
    }


def scrape_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_index_gauge_follows_redis_going_away_and_back(redis_server, start_daemon) -> None:
    """kvfabric_cluster_index_up (what KVFabricIndexUnreachable watches) drops to 0 within a
    few heartbeats of Redis dying and returns to 1 once it is back."""
    node = start_daemon(*cluster_node(redis_server.url, "index-gauge", transport="socket"))

    def index_up() -> float:
        return sample(scrape(node.http_url), "kvfabric_cluster_index_up", index="redis")

    def until(value: float, what: str) -> None:
        deadline = time.monotonic() + 20
        while index_up() != value:
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    until(1, "the node never reported the index reachable")
    redis_server.kill()
    until(0, "the gauge stayed 1 with Redis gone")
    redis_server.start()  # same port, empty: the node registers again
    until(1, "the gauge never came back with Redis")
