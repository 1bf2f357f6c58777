"""Packaging: every package directory ships, under the import name users write."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"kvfabric": ROOT / "kvfabric", "kvfabric_connectors": ROOT / "connectors"}


def test_every_package_directory_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert config["package-dir"] == {"kvfabric_connectors": "connectors"}
    found = set()
    for name, top in SOURCES.items():
        for init in top.rglob("__init__.py"):
            parts = init.parent.relative_to(top).parts
            found.add(".".join((name, *parts)))
    assert found == listed, f"unlisted: {found - listed}; stale: {listed - found}"
