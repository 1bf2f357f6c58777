"""Build kvfabric's wheel the way a user's ``pip`` does, from a clean copy of the tree.

The copy holds what the build reads (pyproject.toml, setup.py, README.md, the two packages)
without compiled modules, ``build/`` or caches: an in-place build of the kernels in the
checkout (``pip install -e``) must not end up in, or stand in for, the wheel under test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("kvfabric/_tokens", "kvfabric/memory/_strided")  # setup.py's extensions


def source_tree(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for package in ("kvfabric", "kvfabric_connectors"):
        shutil.copytree(
            ROOT / package,
            dest / package,
            ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"),
        )
    return dest


def build_wheel(
    python: str | Path,
    source: Path,
    out: Path,
    *,
    isolation: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> tuple[Path, str]:
    """``python -m pip wheel SOURCE --no-deps`` into ``out``: the wheel and pip's verbose
    output (where setup.py's warnings are). ``isolation``: pip installs the build backend
    from the index into a throwaway environment, as for any user; without it the running
    environment's setuptools builds (``--no-build-isolation``)."""
    # a fresh build each time: setuptools would reuse compiled kernels left in build/
    shutil.rmtree(source / "build", ignore_errors=True)
    argv = [str(python), "-m", "pip", "wheel", str(source), "--no-deps", "-v", "-w", str(out)]
    argv += [] if isolation else ["--no-build-isolation"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **(env or {})},
        check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"pip wheel failed ({done.returncode}):\n{log[-4000:]}"
    (wheel,) = out.glob("kvfabric-*.whl")
    return wheel, log


def compiled(wheel: Path) -> list[str]:
    """The kernels' compiled modules in ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        return sorted(n for n in archive.namelist() if n.endswith(".so"))
