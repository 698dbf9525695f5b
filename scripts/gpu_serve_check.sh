#!/usr/bin/env bash
# The product on the GPU, end to end, in one device call: `serve run` of a GPU config on the
# Llama-3-8B-shaped dummy model, bench_serving through HTTP (W2's shape all at once; batch-1
# 512/256; Poisson 4/16/64 req/s of 512/128), then the offline engine's W2 and W3 on the
# same machine, then the Serve path alone with the stand-in engine; one table at the end.
#
# Ray Serve is not on the GPU machine: bring its wheels (../shared/device/serve_wheels.sh
# fetches them into .whl/c1 and .whl/c2 and prints the procedure). Two device calls:
#   1: carry [".whl/c1"], command: mkdir -p /tmp/chunks && cp .whl/c1/* /tmp/chunks/
#   2: carry [".whl/c2"], command: bash scripts/gpu_serve_check.sh
# Or one call, carrying .whl/one (scripts/one_call_wheels.sh packs it from those and .whl/gpu):
# Ray's wheel without its Java jar, stored and xz-compressed (~30 MB), beside the other wheels.
# ENGINE_EXTRA adds engine settings to the served config, e.g.
# ENGINE_EXTRA="quantization: fp8, kv_cache_dtype: fp8_e4m3" (FP8 weights and KV through HTTP;
# OFFLINE_ARGS="--quantization fp8 --kv-cache-dtype fp8_e4m3" gives the offline rows the same).
# ENGINE_EXTRA="kernels: {pdl: false}" switches a kernel path off (A/B; docs/engine.md).
# PARTS (default "serve,offline,path") picks what runs; "startup" measures launch to first
# token of this config twice (scripts/bench_startup.py, plain `serve run`); "profile" adds py-spy of the engine
# replica and an ingress during W2 over HTTP; "gil" runs batch-1 and W2 again with the
# replica's GIL switch interval at 0.5 ms ("sw05": that under "tput"'s mode); "fast" runs them (and batch-1 800/16: a prefill graph past 512 tokens) under Ray's high-throughput mode (the README's, scripts/serve.sh), and with "sampled" W2 again at temperature 1, then also with top_p 0.95 and repetition_penalty 1.05
# (RAY_SERVE_THROUGHPUT_OPTIMIZED=1, RAY_SERVE_ENABLE_HA_PROXY=1), "w2only" keeping only its W2 runs, "b1only" only its batch-1 ones;
# "colo" runs fast's rows (same seeds, a fresh server) with `ingress: colocated` ("cproc": the
# same with `engine_process: true` as well); "tput" under the first of
# those alone (no HAProxy: none of its caveats, docs/deploy.md); "process" runs batch-1 and W2
# with the engine's step loop in a child process of the replica (engine_process: true); "hproc" runs
# those two with the engine process under Ray's high-throughput mode ("fast"'s); "admission" measures the bound, request intake
# and a 10 MB body with the stand-in engine; "fetch" runs scripts/bench_prefix_fetch.py (a returning
# 8k-token history fetched from another replica, two at 0.5 GPU, against computed); "routing" runs
# scripts/bench_routing.py on W2's shape over two engine replicas at 0.5 GPU each (ROUTING_RUNS,
# default ours,ours_one_ingress,ray_prefix; a discarded run first fills the Triton cache). PATH_ARGS overrides the path bench's options; "ceiling"
# runs the path bench's HTTP hop at 512 streams under default Serve and under the high-throughput
# mode (CEILING_ARGS overrides its options). POISSON_RATES (default "4 16 64") sets "serve"'s sweep.
# After each part the table so far goes to $OUT/summary.txt and every file written to
# $OUT/results.tgz (the device brings back eight files at most; a cut-short run keeps what
# its finished parts measured). Budget about 570 s for serve+fast+path+admission.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/radixserve-out}
RES=${RES:-/tmp/radixserve-results}  # everything the parts write; $OUT gets summary.txt + results.tgz
PARTS=${PARTS:-serve,offline,path}
mkdir -p "$OUT" "$RES"
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$@" \
    || { echo "installing the Ray Serve wheels failed"; exit 1; }
}
if [ -d .whl/one ] && [ ! -d /tmp/site/ray ]; then  # one call: Ray's wheel xz-compressed
  ray_xz=$(ls .whl/one/ray-*.whl.xz)
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$ray_xz" "/tmp/$(basename "$ray_xz" .xz)" && install_wheels /tmp/ray-*.whl .whl/one/*.whl
elif [ -d .whl/c2 ] && [ ! -d /tmp/site/ray ]; then
  cp .whl/c2/ray.part.* /tmp/chunks/ && cat /tmp/chunks/ray.part.* > "/tmp/$(cat .whl/c2/ray.name)" &&
    install_wheels /tmp/ray-*.whl .whl/c2/*.whl
fi
# Bytecode as a pip install leaves it: where PYTHONDONTWRITEBYTECODE is set, every Ray worker
# would compile Ray's and this repo's sources again at import (~1.5 s a process here).
python3 -m compileall -q -j 0 /tmp/site engine deployments router frontend > /dev/null 2>&1
# pip --target does not add Ray's commands to a /tmp/site/bin that another install made first
# (FlashInfer's, say): write them then.
for cmd in "serve ray.serve.scripts cli" "ray ray.scripts.scripts main"; do
  set -- $cmd
  [ -e "/tmp/site/bin/$1" ] || [ ! -d /tmp/site/ray ] || {
    mkdir -p /tmp/site/bin
    printf '#!/usr/bin/env python3\nimport sys\nfrom %s import %s\nsys.exit(%s())\n' "$2" "$3" "$3" > "/tmp/site/bin/$1"
    chmod +x "/tmp/site/bin/$1"; }
done
export PYTHONPATH=$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false

MODEL=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import bench_offline; print(bench_offline.model_dir())")
python3 scripts/dummy_tokenizer.py "$MODEL"

write_config() {  # the GPU config: /tmp/gpu_serve.yaml
  cat > /tmp/gpu_serve.yaml <<EOF
proxy_location: EveryNode
http_options: {host: 127.0.0.1, port: 8000}
applications:
  - name: radixserve
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      model: $MODEL
      served_model_name: llama3-8b-dummy
      ray_actor_options: {num_cpus: 4, num_gpus: 1}
      engine: {load_format: dummy, dtype: bfloat16, max_running_requests: 1024,
               chunked_prefill_size: 8192, max_prefill_tokens: 16384, cuda_graph_max_bs: 1024,
               mem_fraction_static: 0.88, max_queued_requests: 2048, grammar_backend: none${ENGINE_EXTRA:+, $ENGINE_EXTRA}}
      ${SERVE_EXTRA:-}
EOF
}

serve_up() {  # start `serve run` and wait until it answers, or fail fast when it died
  write_config
  setsid serve run /tmp/gpu_serve.yaml > "$RES/serve.log" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 1 240); do
    if curl -sf http://127.0.0.1:8000/v1/models > /dev/null; then echo "serve up after ${SECONDS}s"; return 0; fi
    if ! kill -0 $SERVE_PID 2>/dev/null || grep -q "Traceback\|DEPLOY_FAILED\|RuntimeError" "$RES/serve.log"; then
      echo "serve run failed:"; tail -40 "$RES/serve.log"; return 1
    fi
    sleep 1
  done
  echo "serve run did not come up in 240 s:"; tail -40 "$RES/serve.log"; return 1
}

bench() {  # name, then bench_serving options (batch-1 and Poisson runs take seeds of their own:
  # with the warm-up's seed their first prompts would be the warm-up's, radix hits)
  local name=$1; shift
  python3 scripts/bench_serving.py --quiet --prompt-format tokens --token-id-low 100 \
    --token-id-high 120000 --json "$RES/http_$name.json" "$@" 2>&1 | tail -3
}

profile_w2() {  # py-spy of the engine replica and an ingress while W2 runs over HTTP
  bench w2p --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
    --question-len 128 --output-len 256 > /dev/null &
  local pids=($!)
  sleep 7
  for who in EngineReplica OpenAIIngress; do
    pid=$(pgrep -f "ServeReplica:radixserve:$who" | head -1)
    py-spy record -d 4 -r 250 --nonblocking -f raw -o "$RES/pyspy_$who.txt" --pid "$pid" > /dev/null 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"  # not `wait`: serve run is a child too
  for who in EngineReplica OpenAIIngress; do
    echo "== py-spy $who"; python3 scripts/pyspy_top.py "$RES/pyspy_$who.txt" 14 2>&1 | cut -c1-200
  done
}

summary() {  # the table of every run so far
  python3 - "$RES" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
print(f"\n{'run':<16} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT mean':>9} {'ITL p50':>8} {'ITL mean':>8} {'TPOT':>7} {'ok':>5} {'fail':>5}")
for name in ("batch1", "batch1short", "w2", "poisson4", "poisson16", "poisson64", "gil_batch1", "gil_w2",
             "fast_batch1", "fast_batch1short", "fast_batch1mid", "fast_w2", "fast_poisson64",
             "colo_batch1", "colo_batch1short", "colo_batch1mid", "colo_w2", "colo_poisson64", "fast_w2_t1", "fast_w2_sampled", "tput_batch1",
             "tput_batch1short", "tput_w2", "sw05_batch1", "sw05_w2", "proc_batch1", "proc_w2", "hproc_batch1", "hproc_w2", "cproc_batch1", "cproc_batch1short", "cproc_batch1mid", "cproc_w2", "cproc_poisson64", "default_w2", "proc_w2", "custom_w2"):
    m = load(f"http_{name}.json")
    if m:
        m = m.get("metrics", m)
        print(f"{name:<16} {m['output_throughput']:>10.0f} {m['ttft_ms_p50']:>9.1f} {m['ttft_ms_mean']:>9.1f} "
              f"{m['itl_ms_p50']:>8.2f} {m['itl_ms_mean']:>8.2f} {m['tpot_ms_mean']:>7.2f} {m['completed']:>5} {m['failed']:>5}")
off = load("offline.json")
if off and "W2" in off:
    w2, w3 = off.get("W2", {}), off.get("W3", {})
    print(f"offline W2 cache_on: {w2.get('cache_on_output_tok_s', 0):.0f} tok/s; "
          f"W3: TTFT {w3.get('ttft_ms', 0):.1f} ms, step {w3.get('step_ms', 0):.2f} ms")
for name in ("startup_1.txt", "startup_2.txt", "online.txt", "online_table.txt", "path.txt", "ceiling.txt", "admission.txt", "intake.txt",
             "prefix_fetch.txt", "routing.txt"):
    path = os.path.join(out, name)
    if os.path.exists(path):
        print(f"\n{name}:\n" + open(path).read().rstrip())
EOF
}

checkpoint() {  # after each part, so a run cut short still brings back what it measured
  summary > "$RES/summary.txt" 2>&1
  cp "$RES/summary.txt" "$OUT/summary.txt"
  tar -czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null  # one file: $OUT brings back eight at most
}

online_http() {  # name, extra app args: O1 through HTTP in the README's mode (scripts/serve.sh's
  # variables), one rate at a time, with py-spy of the engine replica and an ingress at the top rate
  local name=$1 top=${ONLINE_RATES##*,}
  SECONDS=0
  if RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 SERVE_EXTRA="$2" serve_up; then
    local models_at=$SECONDS body='{"model": "llama3-8b-dummy", "prompt": "w1 w2", "max_tokens": 1}'
    until curl -sf -o /dev/null http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d "$body"; do
      sleep 0.2; [ $SECONDS -lt 300 ] || break
    done
    echo "$name: /v1/models answered ${models_at}s after launch, the first completion ${SECONDS}s" >> "$RES/online.txt"
    for rate in ${ONLINE_RATES//,/ }; do
      if [ "$rate" = "$top" ]; then
        for who in EngineReplica OpenAIIngress; do
          pid=$(pgrep -f "ServeReplica:radixserve:$who" | head -1)
          (sleep 8; py-spy record -d 6 -r 200 --subprocesses --nonblocking -f raw \
             -o "$RES/pyspy_${name}_$who.txt" --pid "$pid" > /dev/null 2>&1) &
        done
      fi
      python3 scripts/bench_online.py http --rates "$rate" --mixes "$ONLINE_MIXES" \
        --duration "$ONLINE_SECONDS" --json "$RES/online_${name}_$rate.json" 2>&1 | grep -v "^[-m]"
    done
    [[ $PARTS != *w2* ]] || bench "${name}_w2" --dataset shared-prefix --num-groups 32 --prompts-per-group 16 \
      --system-len 2048 --question-len 128 --output-len 256
    sleep 2
    for who in EngineReplica OpenAIIngress; do
      echo "== py-spy $name $who"; python3 scripts/pyspy_top.py "$RES/pyspy_${name}_$who.txt" 12 2>&1 | cut -c1-180
    done
    python3 - "$RES" "$name" <<'PY'
import glob, json, sys
res, name = sys.argv[1], sys.argv[2]
rows = [r for f in sorted(glob.glob(f"{res}/online_{name}_*.json")) for r in json.load(open(f))["rows"]]
json.dump({"target": name, "rows": rows}, open(f"{res}/{name}.json", "w"))
PY
  fi
  serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1; pkill -f haproxy > /dev/null 2>&1
}

# "online": O1 (BENCHMARKS.md), the offline engine and then HTTP with the same arrivals;
# ONLINE_MODES lists app-arg variants to serve ("default" = the app as configured)
ONLINE_RATES=${ONLINE_RATES:-16,32} ONLINE_MIXES=${ONLINE_MIXES:-fixed} ONLINE_SECONDS=${ONLINE_SECONDS:-20}
if [[ $PARTS == *startup* ]]; then  # launch to first token of the GPU config, plain `serve run`:
  # first with this machine's Triton cache as it is (empty on a fresh machine), then again
  write_config
  for run in $(seq "${STARTUP_RUNS:-2}"); do
    timeout 280 python3 scripts/bench_startup.py /tmp/gpu_serve.yaml --plain --port 8000 \
      --interval 0.1 --timeout 250 > "$RES/startup_$run.txt" 2>&1
    tail -32 "$RES/startup_$run.txt"
    ray stop --force > /dev/null 2>&1
  done
fi
checkpoint

if [[ $PARTS == *online* ]]; then
  python3 scripts/bench_online.py offline --rates "$ONLINE_RATES" --mixes "$ONLINE_MIXES" \
    --duration "$ONLINE_SECONDS" --reference --json "$RES/online_offline.json" ${ONLINE_ENGINE:+--engine $ONLINE_ENGINE} 2>&1 | grep -v "^[-m]"
  names=""
  for mode in ${ONLINE_MODES:-default}; do
    case $mode in
      default) extra="" ;;
      proc) extra="engine_process: true" ;;
      *) extra=$mode; mode=custom ;;
    esac
    online_http "$mode" "$extra"; names="$names $RES/$mode.json"
  done
  python3 scripts/bench_online.py report "$RES/online_offline.json" $names | tee "$RES/online_table.txt"
fi
checkpoint

if [[ $PARTS == *profile* ]]; then
  SECONDS=0
  if serve_up; then
    bench warm --num-prompts 64 --input-len 512 --output-len 32
    profile_w2
  fi
  serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
fi
checkpoint

if [[ $PARTS == *serve* ]]; then
  SECONDS=0
  if serve_up; then
    bench warm --num-prompts 64 --input-len 512 --output-len 32
    bench batch1 --num-prompts 8 --input-len 512 --output-len 256 --max-concurrency 1 --seed 101
    bench batch1short --num-prompts 16 --input-len 32 --output-len 64 --max-concurrency 1 --seed 102
    bench w2 --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
      --question-len 128 --output-len 256
    for rate in ${POISSON_RATES-4 16 64}; do
      bench "poisson$rate" --num-prompts $((rate * 10)) --input-len 512 --output-len 128 --request-rate $rate --seed $((100 + rate))
    done
    top -b -n 1 -o %CPU | head -15 > "$RES/top.txt"
  fi
  serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
fi
checkpoint

if [[ $PARTS == *fast* ]]; then  # the same app with Ray's high-throughput mode: HAProxy, gRPC between replicas
  SECONDS=0
  if RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 serve_up; then
    bench warm --num-prompts 64 --input-len 512 --output-len 32
    if [[ $PARTS != *w2only* ]]; then
      bench fast_batch1 --num-prompts 8 --input-len 512 --output-len 256 --max-concurrency 1 --seed 101
      bench fast_batch1short --num-prompts 16 --input-len 32 --output-len 64 --max-concurrency 1 --seed 102
      bench fast_batch1mid --num-prompts 16 --input-len 800 --output-len 16 --max-concurrency 1 --seed 103
    fi
    [[ $PARTS == *b1only* ]] || bench fast_w2 --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
      --question-len 128 --output-len 256
    [[ $PARTS == *w2only* || $PARTS == *b1only* ]] || bench fast_poisson64 --num-prompts 640 --input-len 512 --output-len 128 --request-rate 64 --seed 164
    if [[ $PARTS == *sampled* ]]; then  # W2 again, sampled: temperature 1; then with top_p and a penalty
      # other seeds: prompts the greedy run has not cached (the same ones were all radix hits)
      bench fast_w2_t1 --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
        --question-len 128 --output-len 256 --temperature 1.0 --seed 1
      bench fast_w2_sampled --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
        --question-len 128 --output-len 256 --temperature 1.0 --seed 2 \
        --extra-body '{"top_p": 0.95, "repetition_penalty": 1.05}'
    fi
  fi
  serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
  pkill -f haproxy > /dev/null 2>&1  # it would keep port 8000 from the parts after this one
fi
checkpoint

colocated_rows() {  # name prefix, then YAML app args past `ingress: colocated`: "fast"'s runs
  local name=$1 extra=$2
  SECONDS=0
  if RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 SERVE_EXTRA="ingress: colocated$extra" serve_up; then
    bench warm --num-prompts 64 --input-len 512 --output-len 32
    bench "${name}_batch1" --num-prompts 8 --input-len 512 --output-len 256 --max-concurrency 1 --seed 101
    bench "${name}_batch1short" --num-prompts 16 --input-len 32 --output-len 64 --max-concurrency 1 --seed 102
    bench "${name}_batch1mid" --num-prompts 16 --input-len 800 --output-len 16 --max-concurrency 1 --seed 103
    [[ $PARTS == *b1only* ]] || bench "${name}_w2" --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
      --question-len 128 --output-len 256
    [[ $PARTS == *b1only* ]] || bench "${name}_poisson64" --num-prompts 640 --input-len 512 --output-len 128 --request-rate 64 --seed 164
  fi
  serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
  pkill -f haproxy > /dev/null 2>&1
}

# "colo": `ingress: colocated` (deployments/colocated.py); "cproc": that with the engine in a
# child process (no router or gRPC hop per request, and the step loop off the HTTP process's GIL)
[[ $PARTS == *colo* ]] && colocated_rows colo ""
[[ $PARTS == *cproc* ]] && colocated_rows cproc $'\n      engine_process: true'
checkpoint

if [[ $PARTS == *tput* ]]; then  # RAY_SERVE_THROUGHPUT_OPTIMIZED=1 alone: Serve's Python proxy kept
  SECONDS=0
  if RAY_SERVE_THROUGHPUT_OPTIMIZED=1 serve_up; then
    bench warm --num-prompts 64 --input-len 512 --output-len 32
    bench tput_batch1 --num-prompts 8 --input-len 512 --output-len 256 --max-concurrency 1 --seed 101
    bench tput_batch1short --num-prompts 16 --input-len 32 --output-len 64 --max-concurrency 1 --seed 102
    bench tput_w2 --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
      --question-len 128 --output-len 256
  fi
  serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
fi
checkpoint

variant() {  # name prefix, then the app args it adds: batch-1 and W2 over HTTP with them
  local name=$1; shift
  SECONDS=0
  if SERVE_EXTRA="$*" serve_up; then
    bench warm --num-prompts 64 --input-len 512 --output-len 32
    bench "${name}_batch1" --num-prompts 8 --input-len 512 --output-len 256 --max-concurrency 1 --seed 101
    bench "${name}_w2" --dataset shared-prefix --num-groups 32 --prompts-per-group 16 --system-len 2048 \
      --question-len 128 --output-len 256
  fi
  serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
}

if [[ $PARTS == *gil* ]]; then  # the engine replica's GIL switch interval at 0.5 ms
  variant gil "gil_switch_interval_ms: 0.5"
fi
if [[ $PARTS == *sw05* ]]; then  # both: Ray's high-throughput mode and the 0.5 ms switch interval
  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 variant sw05 "gil_switch_interval_ms: 0.5"
fi
checkpoint

if [[ $PARTS == *hproc* ]]; then  # "process" under Ray's high-throughput mode (fast's), batch-1 and W2
  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 variant hproc "engine_process: true"
  pkill -f haproxy > /dev/null 2>&1
fi
if [[ $PARTS == *process* ]]; then  # the engine's step loop in a child process of the replica
  variant proc "engine_process: true"
fi
checkpoint

if [[ $PARTS == *fetch* ]]; then  # a returning 8k-token history fetched from another replica (2 at 0.5 GPU) vs computed
  python3 scripts/bench_prefix_fetch.py --json "$RES/prefix_fetch.json" > "$RES/prefix_fetch.log" 2>&1
  grep -A2 "^| TTFT" "$RES/prefix_fetch.log" > "$RES/prefix_fetch.txt" || tail -5 "$RES/prefix_fetch.log" > "$RES/prefix_fetch.txt"
  ray stop --force > /dev/null 2>&1
fi
checkpoint

if [[ $PARTS == *routing* ]]; then  # W2's shape over 2 engine replicas at 0.5 GPU each, through HTTP
  timeout "${ROUTING_S:-420}" python3 scripts/bench_routing.py --model "$MODEL" --replicas 2 --replica-gpus 0.5 \
    --groups 32 --per-group 16 --system-len 2048 --question-len 128 --output-len 256 \
    --max-total-tokens 100000 --max-running-requests 256 --replica-cpus 4 \
    --engine-kwargs '{"load_format": "dummy", "dtype": "bfloat16"}' \
    --runs "${ROUTING_RUNS:-ours,ours_one_ingress,ray_prefix}" --warm-run --json "$RES/routing.json" \
    > "$RES/routing.txt" 2> "$RES/routing.log"
  grep -E "^\[" "$RES/routing.log" | tail -6; cat "$RES/routing.txt"
  ray stop --force > /dev/null 2>&1
fi
checkpoint

if [[ $PARTS == *offline* ]]; then
  python3 scripts/bench_offline.py --workloads "${OFFLINE_WORKLOADS:-W2,W3}" --w2-modes cache_on --no-hf --skip-check \
    --json "$RES/offline.json" ${OFFLINE_ARGS:-} 2>&1 | grep -E "^W[23] " | cut -c1-300
fi
checkpoint

if [[ $PARTS == *path* ]]; then
  timeout 200 python3 scripts/bench_serve_path.py ${PATH_ARGS:---hops inproc handle http --tokens 64} \
    --json "$RES/path.json" 2>&1 | tee "$RES/path.log" | grep -E "^(inproc|handle|http) " > "$RES/path.txt"
  [ -s "$RES/path.txt" ] || { echo "bench_serve_path printed no rows:"; tail -20 "$RES/path.log"; }
  ray stop --force > /dev/null 2>&1
fi
checkpoint

if [[ $PARTS == *ceiling* ]]; then  # the path's ceiling: default Serve, then HAProxy + gRPC
  args=${CEILING_ARGS:---hops http --streams 512 --tokens 512 --step-ms 5 --ingress-replicas 2}
  for mode in default fast; do
    if [ $mode = fast ]; then envs="RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1"; else envs=""; fi
    env $envs timeout 150 python3 scripts/bench_serve_path.py $args --json "$RES/ceiling_$mode.json" 2>&1 \
      | tee "$RES/ceiling_$mode.log" | grep -E "^http " | sed "s/^/$mode /" >> "$RES/ceiling.txt"
    ray stop --force > /dev/null 2>&1; pkill -f haproxy > /dev/null 2>&1
  done
fi
checkpoint

if [[ $PARTS == *admission* ]]; then  # stand-in engine: the bound, request intake, a 10 MB body
  timeout 150 python3 scripts/bench_serve_path.py --admission --step-ms 20 2>&1 | grep -E "^  |^[a-z]" | tee "$RES/admission.txt"
  ray stop --force > /dev/null 2>&1
  timeout 120 python3 scripts/bench_serve_path.py --intake 512 2176 2>&1 | grep -E "^\{" | tee "$RES/intake.txt"
  ray stop --force > /dev/null 2>&1
fi
checkpoint

cat "$RES/summary.txt"
