#!/usr/bin/env bash
# The test command: the whole CPU suite (GPU tests are selected with `-m gpu` on a GPU box) in
# two pytest-xdist lanes: one runs every file that serves through Ray, one file after another,
# and the files without Ray spread over the workers (tests/conftest.py). TEST_WORKERS=0 runs
# it all in one process. The 30 slowest tests are listed at the end (where CI's time goes).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
exec ${PYTHON:-python3} -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup --durations=30 "$@"
