#!/usr/bin/env bash
# Install everything the test suite needs, then run it. This is the README's test command
# and exactly what CI runs (.ci/run). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# No library may phone home from a test run.
export LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1

bash tests/install.sh

# One pytest-xdist worker per core (at most four), a test module per worker at a time (module
# fixtures share engines and daemons): most of the suite waits on one single-threaded engine
# or daemon, so a second worker roughly halves it on two cores. tests/conftest.py gives each
# worker's engines a core of their own and hands out the engine modules first.
# KVF_TEST_WORKERS=0 runs everything in this one process.
cores=$(nproc)
workers="${KVF_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
# the slowest tests are listed at the end: where the suite's time goes
# --no-loadscope-reorder: modules go out in collection order (tests/conftest.py puts the
# engine modules first), not largest test count first, which left the longest engine modules
# to the end, each on one worker while the other idled.
# --max-worker-restart=0: a worker that crashes (a segfault, an illegal instruction) fails the
# run at once; with replacements, --dist loadfile can wait forever for work that never comes
# (pytest-xdist 3.8.0, issues #784 and #1378) and CI would sit out its whole time limit.
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder \
    --max-worker-restart=0 --durations=25 "$@"
