#!/usr/bin/env bash
# The test command: the whole CPU suite (GPU tests are selected with `-m gpu` on a GPU box),
# in one process. TEST_WORKERS=2 spreads files over pytest-xdist workers (tests/conftest.py
# groups them), which suits the files without Ray only: a file that ends the session's Ray
# cluster or starts one of its own takes the other worker's cluster down (benchmarks/RESULTS.md).
# The 30 slowest tests are listed at the end (where CI's time goes). A crash, even while the
# interpreter exits, prints every thread's stack (-X faulthandler).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
# Bytecode for the project's own modules, as an installed package has it: where
# PYTHONDONTWRITEBYTECODE is set (CI), every Ray worker and engine process would compile
# them from source again.
${PYTHON:-python3} -m compileall -q -j 0 engine deployments router frontend > /dev/null
exec ${PYTHON:-python3} -X faulthandler -m pytest -q -n "${TEST_WORKERS:-0}" --dist loadgroup --durations=30 "$@"
