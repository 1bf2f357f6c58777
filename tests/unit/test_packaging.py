"""Packaging: every package directory ships, under the import name users write; one
version; the Pythons and the dependencies pyproject.toml declares are the ones the code needs.

The engine plugins live in `kvfabric_connectors/`, the folder named as the import package, so
setuptools' package discovery finds them without a package-dir mapping. This asks setuptools
itself (the same discovery the build runs) and compares with the folders on disk.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from setuptools import find_packages

import kvfabric

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("kvfabric", "kvfabric_connectors")


def test_every_package_directory_ships() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in config, "the folders are named as their import packages"
    shipped = set(find_packages(str(ROOT), include=config["packages"]["find"]["include"]))
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOPS
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert shipped == on_disk, f"not shipped: {on_disk - shipped}; unexpected: {shipped - on_disk}"
    assert not any(name.split(".")[0] not in TOPS for name in shipped)


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {Requirement(r).name for r in PROJECT["dependencies"]}
EXTRAS = {
    extra: {Requirement(r).name for r in reqs}
    for extra, reqs in PROJECT["optional-dependencies"].items()
}
# import name -> distribution, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "zmq": "pyzmq", "prometheus_client": "prometheus-client"}
# imported directly, installed by the dependency named: pinned by that one's own requirement
TRANSITIVE = {
    "starlette": "fastapi",
    "anyio": "fastapi",
    "h11": "uvicorn",
    "pydantic_core": "pydantic",
}
# engine plugins: the engine itself is the user's, not in its extra (see pyproject.toml)
CONNECTORS = {
    "vllm": ("vllm", "vllm"),
    "lmcache": ("lmcache", "lmcache"),
    "sglang": ("sglang", "sglang"),
    "hf": (None, "hf"),
}
CAPS_ALLOWED: dict[str, str] = {}  # requirement name -> the incompatibility its cap avoids


def test_the_version_is_written_once() -> None:
    """pyproject.toml reads it from kvfabric/__init__.py (the installed metadata then says
    the same, see test_cli_startup.py); no second copy to forget."""
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["dynamic"]["version"] == {"attr": "kvfabric.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvfabric.__version__)


def test_the_classifiers_name_exactly_the_supported_pythons() -> None:
    supported = SpecifierSet(PROJECT["requires-python"])
    listed = {
        c.rsplit(" :: ", 1)[1]
        for c in PROJECT["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    assert listed == {"3.11", "3.12", "3.13"}
    assert all(f"{v}.0" in supported for v in listed)
    assert "3.10.0" not in supported and "3.14.0" not in supported
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in listed


def test_dependencies_are_floors_without_pins() -> None:
    """Exact versions live in tests/constraints.txt only; a cap needs a known incompatibility
    (CAPS_ALLOWED, with the reason)."""
    every = [
        *PROJECT["dependencies"],
        *(r for v in PROJECT["optional-dependencies"].values() for r in v),
    ]
    for raw in every:
        requirement = Requirement(raw)
        ops = {spec.operator for spec in requirement.specifier}
        assert not ops & {"==", "===", "~="}, f"{raw}: pin it in tests/constraints.txt instead"
        if ops & {"<", "<="}:
            assert requirement.name in CAPS_ALLOWED, f"{raw}: a cap without a known reason"


def _imports_of(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports (inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _imports(folder: Path) -> set[str]:
    """The third-party libraries imported anywhere under ``folder``."""
    names = set().union(*(_imports_of(path) for path in folder.rglob("*.py")))
    ours = {"kvfabric", "kvfabric_connectors", "__future__"}
    return {n for n in names if n not in sys.stdlib_module_names and n not in ours}


def _declared_in(module: str, declared: set[str]) -> bool:
    name = DISTRIBUTION.get(module, module.replace("_", "-"))
    return name in declared or TRANSITIVE.get(module) in declared


def test_every_imported_library_is_declared() -> None:
    """Regression: the daemon imports zmq (its KV event stream) and pyzmq was not a
    dependency: a clean install could not serve (test_wheel_install.py found it)."""
    anywhere = CORE.union(*EXTRAS.values())
    missing = sorted(m for m in _imports(ROOT / "kvfabric") if not _declared_in(m, anywhere))
    assert not missing, f"kvfabric imports {missing}: add them to pyproject.toml"
    for folder, (engine, extra) in CONNECTORS.items():
        declared = CORE | EXTRAS[extra]
        imported = _imports(ROOT / "kvfabric_connectors" / folder) - {engine}
        missing = sorted(m for m in imported if not _declared_in(m, declared))
        assert not missing, f"kvfabric_connectors.{folder} imports {missing}: add to [{extra}]"


def test_only_one_module_imports_nixl() -> None:
    """`nixl` first, `nixl_cu12` as the fallback: kvfabric.transport.nixl_module decides,
    nobody imports either by name."""
    helper = ROOT / "kvfabric" / "transport" / "nixl_module.py"
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            if path != helper:
                assert not {"nixl", "nixl_cu12"} & _imports_of(path), path
