#!/usr/bin/env bash
# `serve run` in Ray Serve's high-throughput mode: the README's command for the main job.
#
#   bash scripts/serve.sh serve_config.yaml        # any `serve run` arguments
#
# The mode (docs/deploy.md, scripts/serve_mode.sh) puts HAProxy in front of the ingress
# replicas instead of Serve's Python proxy and talks gRPC between replicas. Measured on one
# H200 in one call (8B-shaped model, benchmarks/RESULTS.md): W2 over HTTP 95% of the offline
# engine against 81% for plain `serve run`, and ~8 ms less per request.
# RAY_SERVE_LOG_TO_STDERR=1 keeps the replicas' logs in this terminal (the mode sends them to
# files only). Plain `serve run serve_config.yaml` runs Serve's default mode instead.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/serve_mode.sh"
export RAY_SERVE_LOG_TO_STDERR=${RAY_SERVE_LOG_TO_STDERR:-1}
exec serve run "$@"
