"""daemons/kubernetes/ is the chart rendered (deploy/render-manifests.sh), and
deploy/check.sh, the operators' one-command check, passes on the tree."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "daemons" / "kubernetes"


def test_checked_in_manifests_are_the_rendered_chart(chart: Any, tmp_path: Path) -> None:
    """Would have caught an edit to daemons/kubernetes/ by hand, or a chart change without
    `bash deploy/render-manifests.sh` (the plain manifests would drift from the chart)."""
    out = tmp_path / "manifests"
    result = subprocess.run(
        ["bash", str(REPO / "deploy" / "render-manifests.sh"), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "HELM": chart.helm},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rendered = {p.name: p.read_text() for p in sorted(out.glob("*.yaml"))}
    checked_in = {p.name: p.read_text() for p in sorted(MANIFESTS.glob("*.yaml"))}
    assert sorted(checked_in) == sorted(rendered)
    for name, text in rendered.items():
        assert checked_in[name] == text, f"{name} differs: run bash deploy/render-manifests.sh"
    assert {"configmap.yaml", "daemonset.yaml"} <= set(rendered)


def test_deploy_check_script_passes(
    chart: Any, hadolint: str, kube_validate: str, crd_models: Path
) -> None:
    """deploy/check.sh end to end: hadolint, helm lint and template for every values file,
    Kubernetes' and the Prometheus Operator's schemas, the manifests up to date."""
    result = subprocess.run(
        ["bash", str(REPO / "deploy" / "check.sh")],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "HELM": chart.helm,
            "HADOLINT": hadolint,
            "KUBE_VALIDATE": kube_validate,
        },
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "deploy/check.sh: all checks passed" in result.stdout
    assert "FAILED" not in result.stdout + result.stderr


def test_deploy_check_script_fails_on_a_broken_tree(chart: Any, tmp_path: Path) -> None:
    """Negative control: in a copy of the tree with a hand-edited manifest and a Dockerfile
    hadolint refuses, the script runs every check and exits 1 naming both."""
    tree = tmp_path / "tree"
    for part in ("deploy", "daemons"):
        shutil.copytree(REPO / part, tree / part)
    (tree / ".venv").symlink_to(REPO / ".venv")
    with open(tree / "daemons" / "kubernetes" / "daemonset.yaml", "a") as manifest:
        manifest.write("# edited by hand\n")
    dockerfile = tree / "deploy" / "docker" / "Dockerfile.vllm"
    dockerfile.write_text(dockerfile.read_text() + "RUN apt-get install curl\n")
    result = subprocess.run(
        ["bash", str(tree / "deploy" / "check.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "HELM": chart.helm, "KUBE_VERSIONS": "1.37.0"},
        timeout=600,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED: hadolint" in result.stderr
    assert "FAILED: daemons/kubernetes up to date" in result.stderr
    assert "FAILED: helm" not in result.stderr  # the chart itself is fine
