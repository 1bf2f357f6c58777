"""The wheel builds with the optional C kernels, without them on request, and without them
when the compiler fails (a warning, the pure-Python path), from a clean copy of the tree."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from wheel_build import KERNELS, build_wheel, compiled, source_tree

import kvfabric

ABI = sysconfig.get_config_var("EXT_SUFFIX")  # e.g. .cpython-311-x86_64-linux-gnu.so
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return source_tree(tmp_path_factory.mktemp("src"))


def test_the_wheel_carries_both_kernels_built_for_this_python(source: Path, tmp_path) -> None:
    wheel, _ = build_wheel(sys.executable, source, tmp_path)
    assert wheel.name == f"kvfabric-{kvfabric.__version__}-{TAG}-{TAG}-linux_{_machine()}.whl"
    assert compiled(wheel) == sorted(f"{k}{ABI}" for k in KERNELS)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert not [n for n in names if n.endswith((".c", ".h"))]  # sources go to the sdist only
    assert "kvfabric/py.typed" in names and "kvfabric/logfmt.py" in names


def test_no_extension_builds_a_pure_python_wheel(source: Path, tmp_path) -> None:
    wheel, _ = build_wheel(sys.executable, source, tmp_path, env={"KVFABRIC_NO_EXTENSION": "1"})
    assert wheel.name == f"kvfabric-{kvfabric.__version__}-py3-none-any.whl"
    assert compiled(wheel) == []


def test_a_failing_compiler_falls_back_to_pure_python_with_a_warning(
    source: Path, tmp_path
) -> None:
    """Negative control: CC=/bin/false fails every compile; the build still succeeds, says
    so for each kernel, and the wheel's kvfabric runs on its pure-Python paths."""
    wheel, log = build_wheel(sys.executable, source, tmp_path, env={"CC": "/bin/false"})
    assert compiled(wheel) == []
    for kernel in ("kvfabric._tokens", "kvfabric.memory._strided"):
        assert f"WARNING: kvfabric: the optional C kernel {kernel} was not built" in log, log[
            -3000:
        ]
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    code = (
        "import importlib.util, sys\n"
        # this environment's editable install of the checkout would supply its own kernel
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not getattr(f, '__module__', '').startswith('__editable__')]\n"
        "import kvfabric.hashing as h\n"
        "from kvfabric.spec import KVSpec, Namespace\n"
        "assert importlib.util.find_spec('kvfabric._tokens') is None\n"
        "ns = Namespace('m', KVSpec(2, 2, 16, 'bfloat16', chunk_tokens=16))\n"
        "print(len(h.chunk_keys(ns, list(range(40)))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=unpacked,
        env={"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.split() == ["3"], done.stderr


def _machine() -> str:
    return sysconfig.get_platform().rsplit("-", 1)[-1]
