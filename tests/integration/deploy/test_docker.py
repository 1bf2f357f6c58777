"""The images (deploy/docker/): both Dockerfiles pass hadolint, the build context
(.dockerignore) holds what they copy, the wheel their build stage makes holds the compiled
kernels and every file the package reads at run time, and what the daemon image runs works:
`kvfabric serve` with only the package's declared dependencies (what `pip install` of the
wheel brings, which is all the runtime stage installs) becomes ready, and the image's
HEALTHCHECK command says so. No image is built here (no container builder on these
machines, and no registry to pull the base images from)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from child_process import Child

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.vllm"]


def instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"^\s*#.*\n", "", dockerfile.read_text(), flags=re.M)
    return [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(hadolint: str, dockerfile: Path) -> None:
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_careless_dockerfile(hadolint: str, tmp_path: Path) -> None:
    """Negative control: an unpinned base image and an apt-get without -y and cleanup."""
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python:latest\nRUN apt-get update && apt-get install curl\n")
    result = subprocess.run([hadolint, str(careless)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3015" in result.stdout


def test_build_context_holds_what_the_images_copy() -> None:
    """.dockerignore excludes everything but what the COPY lines name: a file added to a
    COPY must be let through there, or the build fails on a fresh clone."""
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for dockerfile in DOCKERFILES:
        copied = set()
        for line in instructions(dockerfile):
            if line.startswith("COPY ") and "--from=" not in line:
                copied.update(word.rstrip("/") for word in line.split()[1:-1])
        assert copied == allowed, dockerfile.name
        assert all((REPO / name).exists() for name in copied)


def test_daemon_image_runs_as_the_daemonset_expects() -> None:
    """The runtime stage's user is the DaemonSet's (uid/gid 2000) and it runs `kvfabric
    serve`, which the DaemonSet's command execs too."""
    lines = instructions(DOCKER / "Dockerfile")
    assert "USER 2000:2000" in lines
    assert 'ENTRYPOINT ["kvfabric", "serve"]' in lines
    daemonset = (REPO / "daemons" / "kubernetes" / "daemonset.yaml").read_text()
    assert "runAsUser: 2000" in daemonset and "exec kvfabric serve --config" in daemonset


def healthcheck_argv() -> list[str]:
    (line,) = [x for x in instructions(DOCKER / "Dockerfile") if x.startswith("HEALTHCHECK ")]
    argv = json.loads(line[line.index(" CMD ") + len(" CMD ") :])
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


# Runs `kvfabric serve` as an installed wheel would, with only the declared dependencies (and
# theirs): any other third-party module is made to look absent. The test environment has far
# more (vLLM's), which would hide a missing dependency.
DECLARED_ONLY = r"""
import importlib.abc, importlib.metadata as md, re, sys
from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

declared, todo = set(), ["kvfabric"]
while todo:
    name = norm(todo.pop())
    if name in declared:
        continue
    declared.add(name)
    try:
        requirements = md.requires(name) or []
    except md.PackageNotFoundError:
        continue
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            todo.append(requirement.name)
undeclared = {
    top for top, dists in md.packages_distributions().items()
    if top not in ("kvfabric", "kvfabric_connectors")
    and not any(norm(d) in declared for d in dists)
}

class Undeclared(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in undeclared:
            raise ModuleNotFoundError(
                f"No module named {name!r} (not a declared dependency of kvfabric)", name=name)
        return None

sys.meta_path.insert(0, Undeclared())
from kvfabric.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_daemon_serves_with_declared_dependencies_and_passes_its_healthcheck(
    tmp_path: Path,
) -> None:
    """Would have caught an image whose daemon dies at start on an import the package does
    not declare (the runtime stage installs the wheel's dependencies and nothing else), and a
    HEALTHCHECK command that does not tell a serving daemon from a stopped one."""
    runner = tmp_path / "declared_only.py"
    runner.write_text(DECLARED_ONLY)
    ready = tmp_path / "ready.json"
    argv = [sys.executable, str(runner), "serve", "--ready-file", str(ready)]
    for item in (
        f"store.data_dir={tmp_path / 'data'}",
        "http.host=127.0.0.1",
        "http.port=0",
        "store.tiers.dram.capacity=64MiB",
        "store.tiers.ssd.capacity=256MiB",
    ):
        argv += ["--set", item]
    daemon = Child("declared-only", argv, tmp_path / "daemon.log").start()
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert daemon.alive, f"the daemon exited: {daemon.tail()}"
            assert time.monotonic() < deadline, f"not ready in 90 s: {daemon.tail()}"
            time.sleep(0.05)
        port = json.loads(ready.read_text())["http_port"]
        env = {**os.environ, "KVFABRIC_HTTP__PORT": str(port)}
        healthy = subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=30)
        assert healthy.returncode == 0, healthy.stderr
        assert daemon.stop(60) == 0, daemon.tail()
        stopped = subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=30)
        assert stopped.returncode != 0
    finally:
        daemon.kill()


def test_wheel_holds_the_kernels_and_the_package_files(tmp_path: Path) -> None:
    """The build stage's `pip wheel` on a copy of the build context: the wheel must hold
    both C kernels (the stage fails without them) and every file of the packages that is not
    Python source (an HTML page, a schema, ...): the image has the wheel and nothing else."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "kvfabric", "kvfabric_connectors"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name)
    for junk in [*source.rglob("__pycache__"), *source.rglob("*.so")]:
        shutil.rmtree(junk) if junk.is_dir() else junk.unlink()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("kvfabric-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for kernel in ("kvfabric/_tokens.", "kvfabric/memory/_strided."):
        assert any(n.startswith(kernel) and n.endswith(".so") for n in names), kernel
    data_files = {
        str(path.relative_to(source))
        for package in ("kvfabric", "kvfabric_connectors")
        for path in (source / package).rglob("*")
        # the kernels' sources (.c, and the header they include) go to the sdist only
        if path.is_file() and path.suffix not in (".py", ".c", ".h") and path.name != "README.md"
    }
    assert data_files - names == set(), "not in the wheel: add them to package-data"
