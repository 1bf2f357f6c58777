"""The layering contracts (pyproject.toml, `[tool.importlinter]`) hold, and they have teeth.

CI runs `lint-imports` (tests/lint.sh); this test also plants an upward import in a copy of the
tree, one per contract kind, and checks that the contracts report it: a contract that names a
package that moved, or a layer list that lost an entry, would keep passing on the real tree
and catch nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("kvfabric", "kvfabric_connectors")

pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason="import-linter is installed by tests/install.sh"
)


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def copy_tree(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(
            ROOT / name, dest / name, ignore=shutil.ignore_patterns("*.so", "__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        # a lower layer reaching up (layers contract)
        ("kvfabric/tiers/base.py", "import kvfabric.store.store", "server > api > store"),
        # the store reaching a plane above it (forbidden contract)
        ("kvfabric/store/index.py", "import kvfabric.client", "know nothing of the planes"),
        # an engine plugin going around the client
        ("kvfabric_connectors/vllm/worker.py", "import kvfabric.store", "only through the client"),
        ("kvfabric/client/client.py", "import kvfabric.server.daemon", "not the daemon"),
    ],
)
def test_a_planted_upward_import_breaks_its_contract(
    tmp_path: Path, module: str, planted: str, contract: str
) -> None:
    tree = copy_tree(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\n{planted}  # planted by the test\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(contract in line for line in broken), result.stdout
