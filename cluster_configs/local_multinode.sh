#!/usr/bin/env bash
# A Ray cluster from machines you already have (or several terminals on one machine), then
# radixserve on it. Run from the repository root on each machine:
#
#   bash cluster_configs/local_multinode.sh head              # on the head machine
#   bash cluster_configs/local_multinode.sh worker HEAD_IP    # on every other machine
#   bash cluster_configs/local_multinode.sh deploy            # on the head: the Serve app
#   bash cluster_configs/local_multinode.sh stop              # anywhere: this machine leaves
#
# Every machine needs the same radixserve checkout and Python environment (bash
# scripts/setup.sh) and, for a real model, the model directory at the same path.
# Environment: RAY_PORT (6379), METRICS_PORT (8080), SERVE_CONFIG (serve_config.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_PORT=${RAY_PORT:-6379}
METRICS_PORT=${METRICS_PORT:-8080}
SERVE_CONFIG=${SERVE_CONFIG:-serve_config.yaml}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
# Serve's high-throughput mode, as scripts/serve.sh (docs/deploy.md), read when `ray start`
# starts this node. Set RAY_SERVE_ENABLE_HA_PROXY=0 RAY_SERVE_THROUGHPUT_OPTIMIZED=0 first for
# Serve's default mode (e.g. two nodes on one machine: each node's HAProxy wants port 8000).
source scripts/serve_mode.sh

case "${1:-}" in
  head)
    # The dashboard (8265) serves `serve deploy`; Prometheus reads the metrics port.
    ray start --head --port="$RAY_PORT" --dashboard-host=0.0.0.0 --metrics-export-port="$METRICS_PORT"
    ;;
  worker)
    head_ip=${2:?usage: $0 worker HEAD_IP}
    ray start --address="$head_ip:$RAY_PORT" --metrics-export-port="$METRICS_PORT"
    ;;
  deploy)
    serve deploy "$SERVE_CONFIG"
    echo "status: serve status   API: http://$(hostname -I | awk '{print $1}'):8000/v1/models"
    ;;
  stop)
    ray stop
    ;;
  *)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
