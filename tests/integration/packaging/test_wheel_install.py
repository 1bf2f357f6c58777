"""The wheel, built by each supported Python found here and installed into a clean venv with
the core dependencies only (no torch: an unpinned one would be a multi-GB CUDA build), runs:
``kvfabric --version``, ``kvfabric doctor --json`` and a daemon round trip (serve, put,
lookup through the CLI). Needs the package index for the dependencies (the pip cache makes
later runs quicker); about a minute per Python on two cores."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from child_process import Child
from wheel_build import KERNELS, build_wheel, compiled, source_tree

import kvfabric

SUPPORTED = ("3.11", "3.12", "3.13")  # pyproject.toml's requires-python and classifiers
NAMESPACE = ["--model", "wheel-test", "--layers", "2", "--kv-heads", "2", "--head-dim", "16"]
NAMESPACE += ["--chunk-tokens", "16"]
TOKENS = " ".join(str(i) for i in range(40))  # two whole chunks of 16 and a partial one


def interpreter(version: str) -> str | None:
    """This machine's CPython ``version``: pyenv's builds first (they have venv and ensurepip;
    Debian's python3.X may lack them), then one on PATH."""
    found = sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python{version}"))
    candidates = [*reversed(found), shutil.which(f"python{version}")]
    for candidate in candidates:
        if candidate and _has_venv(candidate):
            return candidate
    return None


def _has_venv(python: str) -> bool:
    probe = subprocess.run(
        [python, "-c", "import venv, ensurepip"], capture_output=True, timeout=60, check=False
    )
    return probe.returncode == 0


def run(argv: list[str], *, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFABRIC_", "PYTHON"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, check=False, **kwargs
    )


@pytest.mark.slow
@pytest.mark.parametrize("version", SUPPORTED)
def test_the_wheel_installs_and_runs_on_each_supported_python(
    version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no CPython {version} with venv on this machine")
    # away from the checkout: `python -c` would import its kvfabric/ (the current directory
    # comes first on sys.path), not the wheel's
    monkeypatch.chdir(tmp_path)
    venv = tmp_path / "venv"
    assert run([python, "-m", "venv", str(venv)]).returncode == 0
    bin_dir = venv / "bin"

    # built by this Python, as pip does from the sdist: the kernels compile for its ABI
    wheel, log = build_wheel(
        bin_dir / "python", source_tree(tmp_path / "src"), tmp_path / "dist", isolation=True
    )
    abi = f"cp{version.replace('.', '')}"
    assert f"-{abi}-{abi}-" in wheel.name, wheel.name
    assert [name.split(".")[0] for name in compiled(wheel)] == sorted(KERNELS), log[-3000:]

    installed = run([str(bin_dir / "python"), "-m", "pip", "install", str(wheel)])
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    listed = run([str(bin_dir / "python"), "-m", "pip", "list", "--format", "json"])
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "torch" not in names and not any(n.startswith("nvidia-") for n in names)

    kvf = str(bin_dir / "kvfabric")
    version_line = run([kvf, "--version"])
    assert version_line.stdout == f"kvfabric {kvfabric.__version__}\n", version_line.stderr
    where = "import kvfabric._tokens as t, kvfabric.memory._strided; print(t.__file__)"
    kernels = run([str(bin_dir / "python"), "-c", where])
    assert kernels.returncode == 0, kernels.stderr
    assert kernels.stdout.startswith(str(venv)), kernels.stdout  # the wheel's, compiled

    data = tmp_path / "data"
    settings = [
        "--data-dir",
        str(data),
        "--http-port",
        "0",
        "--set",
        "store.tiers.dram.capacity=16MiB",
        "--set",
        "store.tiers.ssd.capacity=64MiB",
    ]
    if run([kvf, "doctor", "--help"]).returncode == 0:  # written alongside this test
        doctor = run([kvf, "doctor", "--json", "--ssd-test-size", "0", *settings], timeout=120)
        assert doctor.returncode in (0, 1, 2), doctor.stderr  # its verdict, not a crash
        assert isinstance(json.loads(doctor.stdout), dict), doctor.stdout

    ready = tmp_path / "ready.json"
    daemon = Child(
        f"wheel-{version}",
        [kvf, "serve", "--ready-file", str(ready), *settings],
        tmp_path / "daemon.log",
        env={k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")},
    ).start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert daemon.alive, (tmp_path / "daemon.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the daemon did not start in 60 s"
            time.sleep(0.05)
        socket = json.loads(ready.read_text())["socket"]
        put = run([kvf, "put", "--socket", socket, *NAMESPACE, "--tokens", TOKENS, "--json"])
        assert put.returncode == 0, put.stderr
        assert json.loads(put.stdout)["stored_chunks"] == 3
        lookup = run([kvf, "lookup", "--socket", socket, *NAMESPACE, "--tokens", TOKENS, "--json"])
        assert lookup.returncode == 0, lookup.stderr
        # whole chunks: the partial third one is stored, but a lookup counts whole ones
        assert json.loads(lookup.stdout)["matched_tokens"] == 32, lookup.stdout
        assert daemon.stop(30, signal.SIGTERM) == 0, (tmp_path / "daemon.log").read_text()[-3000:]
    finally:
        daemon.kill()
