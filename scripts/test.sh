#!/usr/bin/env bash
# The test command: the whole CPU suite (GPU tests are selected with `-m gpu` on a GPU box),
# on two pytest-xdist workers, each file on one worker (tests/conftest.py groups them).
# TEST_WORKERS=0 runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
exec ${PYTHON:-python3} -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
