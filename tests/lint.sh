#!/usr/bin/env bash
# The house's rules, checked: formatting and lint (ruff), types (mypy, strict, on kvfabric/ and
# kvfabric_connectors/), the layering (import-linter contracts in pyproject.toml). CI runs it
# before the tests (.ci/run); `pre-commit install` runs the same checks before each commit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/install.sh
export PATH="$PWD/.venv/bin:$PATH"
set -x
ruff format --check .
ruff check .
mypy
lint-imports
# the image, the Helm chart, the manifests and the alert rules (hadolint, helm lint / template,
# Kubernetes and Prometheus Operator schemas; tests/integration/deploy runs them too)
bash deploy/check.sh
