#!/usr/bin/env bash
# `serve run` in Ray Serve's high-throughput mode: the README's command for the main job.
#
#   bash scripts/serve.sh serve_config.yaml        # any `serve run` arguments
#
# The mode (docs/deploy.md) puts HAProxy in front of the ingress replicas instead of Serve's
# Python proxy and talks gRPC between replicas. Measured on one H200 in one call (8B-shaped
# model, benchmarks/RESULTS.md): W2 over HTTP 95% of the offline engine against 81% for plain
# `serve run`, and ~8 ms less per request.
# Serve reads these variables when the cluster and its processes start, so they are set here,
# before `serve run` starts Ray; a variable already set in the environment wins.
# RAY_SERVE_LOG_TO_STDERR=1 keeps the replicas' logs in this terminal (the mode sends them to
# files only). RADIXSERVE_PLAIN_SERVE=1 runs plain `serve run` instead.
set -euo pipefail
if [ "${RADIXSERVE_PLAIN_SERVE:-0}" != 1 ]; then
  export RAY_SERVE_THROUGHPUT_OPTIMIZED=${RAY_SERVE_THROUGHPUT_OPTIMIZED:-1}
  export RAY_SERVE_ENABLE_HA_PROXY=${RAY_SERVE_ENABLE_HA_PROXY:-1}
  export RAY_SERVE_LOG_TO_STDERR=${RAY_SERVE_LOG_TO_STDERR:-1}
fi
exec serve run "$@"
