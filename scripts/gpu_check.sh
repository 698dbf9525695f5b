#!/usr/bin/env bash
# One device call for a session with GPU time: every GPU test (structured output and the
# overlap scheduler's GPU tests too, when the wheels of scripts/gpu_wheels.sh are carried),
# then W2 with its time split and a kernel profile of three decode steps.
#
#   device run: command "bash scripts/gpu_check.sh", carry [".whl"]
#   WORKLOADS=W2,W3 W2_MODES=cache_on,plain_decode PROFILE=120:123 bash scripts/gpu_check.sh
#   ENGINE_ARGS="--engine kernels.pdl=false" bash scripts/gpu_check.sh   # a kernel path off (A/B)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-/tmp/radixserve-out}
mkdir -p "$OUT"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py \
  tests/test_triton_attention.py tests/test_prefix_groups.py tests/test_fused_kernels.py 2>&1 | tail -20
python3 scripts/bench_offline.py --workloads "${WORKLOADS:-W2}" --w2-modes "${W2_MODES:-cache_on}" \
  --profile-w2 "${PROFILE:-120:123}" --no-hf --skip-check --json "$OUT/bench_offline.json" \
  ${ENGINE_ARGS:-} 2>&1 | tail -60
