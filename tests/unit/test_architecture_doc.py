"""docs/architecture.md names the code as it is.

Every ``kvfabric...`` name the page shows is a module (or an attribute of one); every package
and top-level module of ``kvfabric`` and ``kvfabric_connectors`` is in its module map; and its
"Who imports whom" table is exactly the import graph between them (built by grimp, the
library ``lint-imports`` runs on), so the layering it describes is the one the code has.
"""

from __future__ import annotations

import ast
import pkgutil
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
NAME = re.compile(r"`(kvfabric(?:_connectors)?(?:\.\w+)*)`")
ROW = re.compile(r"^\| `([\w.]+)` \| (.*) \|$")


def section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]


def table(text: str) -> dict[str, set[str]]:
    """A two-column table of names: first column -> the names in the second."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows[match[1]] = set(NAME.findall(match[2]))
    return rows


def module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def resolves(name: str) -> bool:
    """A module of the tree, or a name defined at the top of one (found without importing:
    some connectors import engines that are not installed everywhere); a compiled module by
    its C source (setup.py builds it)."""
    if module_file(name) is not None or ROOT.joinpath(*name.split(".")).with_suffix(".c").is_file():
        return True
    module, _, attr = name.rpartition(".")
    source = module_file(module)
    if source is None:
        return False
    defined = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return attr in defined


def units() -> set[str]:
    """The packages and top-level modules the map and the graph are about."""
    out = {"kvfabric", "kvfabric_connectors"}
    for package in out.copy():
        out |= {f"{package}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / package)])}
    return out


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "kvfabric_connectors" else ".".join(parts[:2])


def test_every_name_on_the_page_exists() -> None:
    missing = sorted({n for n in NAME.findall(PAGE.read_text()) if not resolves(n)})
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_the_module_map_names_every_package_and_top_level_module() -> None:
    mapped = set(table(section(PAGE.read_text(), "## Module map")))
    assert not units() - mapped, f"add to the module map: {sorted(units() - mapped)}"


def test_a_module_missing_from_the_map_is_caught() -> None:
    """Negative control: a map without ``kvfabric.store`` fails the check above."""
    text = section(PAGE.read_text(), "## Module map").replace("| `kvfabric.store` |", "| x |")
    assert "kvfabric.store" in units() - set(table(text))


def import_graph() -> dict[str, set[str]]:
    grimp = pytest.importorskip("grimp", reason="grimp comes with the lint extra")
    graph = grimp.build_graph("kvfabric", "kvfabric_connectors")
    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        source = unit_of(module)
        edges.setdefault(source, set())
        for imported in graph.find_modules_directly_imported_by(module):
            if unit_of(imported) != source:
                edges[source].add(unit_of(imported))
    return edges


def graph_drift(documented: dict[str, set[str]], real: dict[str, set[str]]) -> list[str]:
    out = []
    for unit in sorted(set(documented) | set(real)):
        added = real.get(unit, set()) - documented.get(unit, set())
        dropped = documented.get(unit, set()) - real.get(unit, set())
        if added:
            out.append(f"{unit} now imports {sorted(added)}")
        if dropped:
            out.append(f"{unit} no longer imports {sorted(dropped)}")
    return out


def test_the_import_table_is_the_import_graph() -> None:
    documented = table(section(PAGE.read_text(), "### Who imports whom"))
    drift = graph_drift(documented, import_graph())
    assert not drift, (
        "docs/architecture.md's 'Who imports whom' is stale (check the new edge against the "
        "layering first): " + "; ".join(drift)
    )


def test_a_new_import_is_caught() -> None:
    """Negative control: an edge the page does not list is reported."""
    documented = table(section(PAGE.read_text(), "### Who imports whom"))
    real = {unit: set(deps) for unit, deps in documented.items()}
    real["kvfabric.store"].add("kvfabric.server")
    assert graph_drift(documented, real) == ["kvfabric.store now imports ['kvfabric.server']"]


def test_a_name_that_does_not_exist_is_caught() -> None:
    """Negative control of the first check."""
    assert resolves("kvfabric.spec.KVSpec") and resolves("kvfabric.server.handlers")
    assert not resolves("kvfabric.spec.NoSuchThing")
    assert not resolves("kvfabric.no_such_module")


def test_every_import_contract_is_on_the_page() -> None:
    """Each contract of ``[tool.importlinter]`` in pyproject.toml, by name, under Contracts."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    listed = section(PAGE.read_text(), "### Contracts")
    missing = [c["name"] for c in contracts if f"**{c['name']}**" not in listed]
    assert not missing, f"docs/architecture.md's Contracts lack {missing}"
