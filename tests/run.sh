#!/usr/bin/env bash
# Install everything the test suite needs, then run it. This is the README's test command
# and exactly what CI runs (.ci/run). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# No library may phone home from a test run.
export LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1

bash tests/install.sh

# the slowest tests are listed at the end: where the suite's time goes
exec .venv/bin/python -m pytest --durations=25 "$@"
