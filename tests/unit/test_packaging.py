"""Packaging: every package directory ships, under the import name users write.

The engine plugins live in `kvfabric_connectors/`, the folder named as the import package, so
setuptools' package discovery finds them without a package-dir mapping. This asks setuptools
itself (the same discovery the build runs) and compares with the folders on disk.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

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
