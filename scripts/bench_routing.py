#!/usr/bin/env python
"""Request routers compared on a shared-prefix workload, end to end on a local Ray cluster.

Each run starts the radixserve app afresh (new replicas, empty radix caches), warms every
replica (requests sharing nothing with the workload, then a cache flush), sends the same
W2-style workload through the HTTP API (`scripts/bench_serving.py`: `num_groups` system
prompts of `system_len` tokens, `per_group` distinct questions each, shuffled with a fixed
seed, fixed output lengths with ignore_eos; like BENCHMARKS.md's W2 all requests are sent at
once unless `--concurrency` caps the requests in flight), and reads every engine replica's
own counters before and after (`scripts/serve_replicas.py`), so the hit rate is what the
radix caches really served.

Evidence that each router really routed: Ray's router keeps its prefix tree in a detached
actor; the run reads the characters it recorded per replica (`ray_tree_chars`), and fails
if the tree is missing or empty. Ours reports its counters through `/v1/stats` (`router`:
routed with/without a match, load fallbacks, predicted cached tokens vs the replicas'
actual ones).

Runs (every one with the app's default ingress count, two per engine replica, unless
`--ingress-replicas` says otherwise):
    single_replica    one replica serving everything (the hit-rate ceiling)
    pow2              Serve's default power-of-two-choices router
    ray_prefix        Ray's PrefixCacheAffinityRouter (ray.serve.llm.request_router)
    ours              router.request_router:PrefixAwareRequestRouter
    ours_one_ingress  ours behind a single ingress replica (one router instance)

Workloads (`--workload`; explicit --groups/--per-group/--max-total-tokens win):
    default            16 groups x 8, 8192 KV slots per replica (fits)
    many-small-groups  64 groups x 4, 4096 KV slots per replica: the groups' prefixes do
                       not all fit, so misplacing a request costs an eviction too

    python scripts/bench_routing.py                       # 4 replicas, 16 x 8 requests
    python scripts/bench_routing.py --workload many-small-groups
    python scripts/bench_routing.py --model demo --runs pow2,ours --json out.json
    # W2's shape on one GPU, two engine replicas at half a GPU each. Give the KV pool in
    # tokens: mem_fraction_static counts what the other replica on the card took as used.
    # (A config-only dummy model directory needs --engine-kwargs '{"load_format": "dummy"}'.)
    python scripts/bench_routing.py --model /models/llama-8b --replicas 2 --replica-gpus 0.5 \\
        --groups 32 --per-group 16 --system-len 2048 --question-len 128 --output-len 256 \\
        --max-total-tokens 150000 --max-running-requests 256 --runs ours,ours_one_ingress
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serving import make_args, run_benchmark  # noqa: E402

APP, DEPLOYMENT = "radixserve", "EngineReplica"
RAY_TREE_ACTOR, RAY_TREE_NAMESPACE = "LlmPrefixTreeActor", f"serve::{APP}::{DEPLOYMENT}"
ROUTER_COUNTERS = ("routed_with_match", "routed_without_match", "overflows", "load_fallbacks",
                   "misroutes", "digest_corrections", "predicted_matched_tokens")
RUNS = ("single_replica", "pow2", "ray_prefix", "ours", "ours_one_ingress")
# name: (groups, per group, KV slots per replica)
WORKLOADS = {"default": (16, 8, 8192), "many-small-groups": (64, 4, 4096)}
RAY_PREFIX_PUBLIC = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
# The same class; `ray.serve.llm` imports pyarrow at package import, the internal module
# does not, so the internal path works where pyarrow is not installed.
RAY_PREFIX_INTERNAL = ("ray.llm._internal.serve.routing_policies.prefix_aware."
                       "prefix_aware_router:PrefixCacheAffinityRouter")
# Warm-up prompts use ids below the workload's range (10..759), so they share no prefix with it.
WARMUP_TOKEN_IDS = range(5, 10)
# A tiny Llama big enough that prefill (what a cache hit saves) costs real time on a CPU.
BENCH_MODEL = dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=6,
                   num_attention_heads=12, num_key_value_heads=4)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {RUNS}")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--model", default="bench",
                   help="'bench' (a 6-layer, 768-wide random Llama, ~60M parameters), 'demo', or a HF model directory")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--per-group", type=int, default=None)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=0,
                   help="cap on requests in flight; 0 (the default): all at once, as in W2")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV slots per replica; 0: the engine's own sizing (GPU: mem_fraction_static)")
    p.add_argument("--single-kv", choices=["aggregate", "same"], default="aggregate",
                   help="single replica's KV slots: all replicas' together (same total memory) "
                        "or one replica's")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--replica-cpus", type=float, default=1.0,
                   help="logical CPUs per replica (Ray sets its OMP threads from it); the "
                        "single replica gets replicas x this, capped at the machine's cores")
    p.add_argument("--stats-period", type=float, default=1.0,
                   help="request_routing_stats_period_s (the app's default: 1 s)")
    p.add_argument("--replica-gpus", type=float, default=0.0,
                   help="GPUs per engine replica (0.5: two replicas share one GPU)")
    p.add_argument("--ingress-replicas", type=int, default=None,
                   help="ingress replicas of every run but ours_one_ingress (default: the app's)")
    p.add_argument("--engine-kwargs", type=json.loads, default={},
                   help='JSON engine settings for every run, e.g. {"load_format": "dummy"}')
    p.add_argument("--router-kwargs", type=json.loads, default={},
                   help="JSON request_router_kwargs for ours")
    p.add_argument("--ray-router-kwargs", type=json.loads, default={},
                   help="JSON request_router_kwargs for Ray's router (default: as shipped; in Ray "
                        "2.60 that is imbalanced_threshold=inf, match_rate_threshold=0.1)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every configuration this many times (rotating the order) and "
                        "report medians: on a shared machine, throughput is noisy")
    p.add_argument("--warm-run", action="store_true",
                   help="run the first configuration once more before the measured runs and "
                        "discard it: on a GPU with an empty Triton cache, the first run to meet "
                        "the workload's shapes pays their kernels' compiles")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    return p


def resolve_model(name: str) -> str:
    from engine.loading.demo_model import build_tiny_model, default_cache_root, ensure_demo_model

    if name == "demo":
        return ensure_demo_model()
    if name == "bench":
        return build_tiny_model(default_cache_root() / "bench-routing-h768l6", "llama", **BENCH_MODEL)
    return name


def ray_prefix_router_class() -> str:
    try:
        import ray.serve.llm.request_router  # noqa: F401
        return RAY_PREFIX_PUBLIC
    except ImportError:
        import importlib

        module, _, name = RAY_PREFIX_INTERNAL.partition(":")
        getattr(importlib.import_module(module), name)
        return RAY_PREFIX_INTERNAL


def app_args(run: str, opts: argparse.Namespace, model: str) -> dict[str, Any]:
    cpus, gpus = opts.replica_cpus, opts.replica_gpus
    replicas = opts.replicas
    kv = opts.max_total_tokens
    if run == "single_replica":
        replicas, cpus = 1, min(opts.replica_cpus * opts.replicas, float(os.cpu_count() or 1))
        gpus = min(gpus * opts.replicas, 1.0)
        if opts.single_kv == "aggregate":
            kv *= opts.replicas
    router: dict[str, Any] = {"request_routing_stats_period_s": opts.stats_period}
    if run in ("single_replica", "pow2"):
        router["request_router_class"] = "default"
    elif run == "ray_prefix":
        router["request_router_class"] = ray_prefix_router_class()
        router["request_router_kwargs"] = dict(opts.ray_router_kwargs)
    else:
        router["request_router_class"] = "prefix"
        router["request_router_kwargs"] = dict(opts.router_kwargs)
    engine = {"max_running_requests": opts.max_running_requests, "chunked_prefill_size": 512,
              **opts.engine_kwargs}
    if kv:
        engine["max_total_tokens"] = kv
    actor = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {})}
    args = {"model": model, "num_replicas": replicas, "ray_actor_options": actor,
            "engine": engine, "router": router, "graceful_shutdown_timeout_s": 5.0}
    if run == "ours_one_ingress":
        args["ingress_replicas"] = 1
    elif opts.ingress_replicas:
        args["ingress_replicas"] = opts.ingress_replicas
    return args


def resolve_workload(opts: argparse.Namespace) -> None:
    """Fill --groups, --per-group and --max-total-tokens left unset from --workload."""
    groups, per_group, kv = WORKLOADS[opts.workload]
    opts.groups = groups if opts.groups is None else opts.groups
    opts.per_group = per_group if opts.per_group is None else opts.per_group
    opts.max_total_tokens = kv if opts.max_total_tokens is None else opts.max_total_tokens


def replica_counters() -> dict[str, dict]:
    """Each engine replica's own counters, plus the CPU seconds its process has used
    (the work the routing caused, which other load on a shared machine does not inflate)."""
    from serve_replicas import call_each, list_replicas, replica_pids

    replicas = list_replicas(APP, DEPLOYMENT)
    out = call_each(replicas, "stats", timeout=120)
    for rid, pid in replica_pids(replicas).items():
        out[rid]["cpu_s"] = process_cpu_seconds(pid)
    return out


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a local process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def warm_every_replica(base_url: str, rounds: int = 8) -> int:
    """Send requests that share nothing with the workload until every replica has served
    one (first-call costs are paid outside the measurement by all replicas alike, not only
    by the one a single warm-up request reaches), then empty every radix cache. Returns the
    number of warm-up requests sent."""
    import httpx

    from serve_replicas import call_each, list_replicas

    replicas = list_replicas(APP, DEPLOYMENT)
    rng = random.Random(12345)
    sent = 0

    def one(first: int) -> None:
        # Distinct first tokens: no router sees two warm-ups as sharing a prefix.
        prompt = [first] + [rng.choice(WARMUP_TOKEN_IDS) for _ in range(63)]
        r = httpx.post(f"{base_url}/v1/completions", timeout=300,
                       json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        r.raise_for_status()

    with ThreadPoolExecutor(len(replicas)) as pool:
        for _ in range(rounds):
            cold = [k for k, s in call_each(replicas, "stats", timeout=120).items()
                    if s["finished_requests"] == 0]
            if not cold:
                break
            firsts = [WARMUP_TOKEN_IDS[(sent + i) % len(WARMUP_TOKEN_IDS)] for i in range(len(replicas))]
            list(pool.map(one, firsts))
            sent += len(firsts)
        else:
            print(f"warning: {len(cold)} replica(s) still cold after warm-up", file=sys.stderr)
    call_each(replicas, "flush_cache", timeout=120)
    return sent


def ray_tree_chars() -> dict[str, int]:
    """Characters Ray's PrefixCacheAffinityRouter has recorded per replica (its detached
    tree actor): proof that it, not a fallback, did the routing."""
    import ray

    tree = ray.get_actor(RAY_TREE_ACTOR, namespace=RAY_TREE_NAMESPACE)
    counts = ray.get(tree.getattr.remote("tenant_to_char_count"), timeout=60)
    return {tenant.rsplit("#", 1)[-1]: n for tenant, n in counts.items()}


def router_counters(base_url: str) -> dict[str, int]:
    """Our router's counters from `/v1/stats` ({} for routers that have none)."""
    import httpx

    r = httpx.get(f"{base_url}/v1/stats", timeout=120)
    r.raise_for_status()
    return dict(r.json().get("router") or {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(run: str, opts: argparse.Namespace, model: str, base_url: str) -> dict[str, Any]:
    from ray import serve

    from deployments.app import build_app

    t0 = time.perf_counter()
    serve.run(build_app(app_args(run, opts, model)), name=APP, route_prefix="/")
    startup_s = time.perf_counter() - t0
    warmups = warm_every_replica(base_url)
    time.sleep(2 * opts.stats_period + 0.5)  # the flushed caches' digests reach our routers
    before = replica_counters()
    router_before = router_counters(base_url)
    tree_before = ray_tree_chars() if run == "ray_prefix" else {}
    bench = make_args(
        base_url=base_url, dataset="shared-prefix", num_groups=opts.groups,
        prompts_per_group=opts.per_group, system_len=opts.system_len,
        question_len=opts.question_len, output_len=opts.output_len,
        max_concurrency=opts.concurrency or None, token_id_low=10, token_id_high=760,
        warmup_requests=0, seed=opts.seed, quiet=True)
    metrics = asyncio.run(run_benchmark(bench))
    after = replica_counters()
    router_after = router_counters(base_url)
    tree_after = ray_tree_chars() if run == "ray_prefix" else {}
    serve.delete(APP)
    if run == "ray_prefix":
        _drop_ray_prefix_tree()
        grown = {k: n - tree_before.get(k, 0) for k, n in tree_after.items()}
        if sum(grown.values()) <= 0:
            raise RuntimeError(f"Ray's prefix tree recorded nothing: {tree_before} -> {tree_after}")
    router = {k: v - router_before.get(k, 0) for k, v in router_after.items()
              if isinstance(v, (int, float)) and k in ROUTER_COUNTERS}

    per_replica = []
    for rid in sorted(after):
        a, b = after[rid], before.get(rid, {})
        per_replica.append({
            "replica": rid,
            "requests": a["finished_requests"] - b.get("finished_requests", 0),
            "prompt_tokens": a["prompt_tokens"] - b.get("prompt_tokens", 0),
            "cached_tokens": a["cached_tokens"] - b.get("cached_tokens", 0),
            "cpu_s": a["cpu_s"] - b.get("cpu_s", 0.0),
            # without a delta channel: one Ray object per request per step (deployments/channel.py)
            "on_own_stream": a.get("requests_on_own_stream", 0) - b.get("requests_on_own_stream", 0),
        })
    prompt = sum(p["prompt_tokens"] for p in per_replica)
    cached = sum(p["cached_tokens"] for p in per_replica)
    if run == "ray_prefix":
        for p in per_replica:
            p["ray_tree_chars"] = grown.get(p["replica"], 0)
    out = {
        "hit_rate": cached / prompt if prompt else 0.0,
        "client_hit_rate": metrics["cache_hit_rate"],  # from usage.cached_tokens; should agree
        "output_tok_s": metrics["output_throughput"],
        "req_s": metrics["request_throughput"],
        "p50_ms": metrics["e2e_ms_p50"],
        "p99_ms": metrics["e2e_ms_p99"],
        "ttft_p50_ms": metrics["ttft_ms_p50"],
        "ttft_p99_ms": metrics["ttft_ms_p99"],
        "duration_s": metrics["duration_s"],
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "first_errors": metrics["first_errors"],
        "requests_per_replica": [p["requests"] for p in per_replica],
        "engine_cpu_s": sum(p["cpu_s"] for p in per_replica),
        "per_replica": per_replica,
        "startup_s": startup_s,
        "router_class": app_args(run, opts, model)["router"]["request_router_class"],
        "warmup_requests": warmups,
    }
    if router:  # ours: what it predicted, next to what the replicas actually found
        router["actual_cached_tokens"] = cached
        out["router"] = router
    return out


def summarize(repeats: list[dict]) -> dict[str, Any]:
    """Medians of the numbers over repeats (the first repeat's lists), plus every repeat."""
    out = dict(repeats[0])
    for key, value in repeats[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in repeats)
    out["failed"] = sum(r["failed"] for r in repeats)
    if "router" in repeats[0]:
        out["router"] = {k: statistics.median(r["router"][k] for r in repeats)
                         for k in repeats[0]["router"]}
    if len(repeats) > 1:
        out["repeats"] = repeats
    return out


def _drop_ray_prefix_tree() -> None:
    """Ray's router keeps its prefix tree in a detached actor that only serve.shutdown()
    removes; a later run of the same app would inherit the old replicas' entries."""
    import ray

    try:
        ray.kill(ray.get_actor(RAY_TREE_ACTOR, namespace=RAY_TREE_NAMESPACE))
    except ValueError:
        pass


def format_table(results: dict[str, dict], opts: argparse.Namespace) -> str:
    head = (f"{'run':<15}{'hit rate':>9}{'client':>8}{'out tok/s':>11}{'req/s':>7}{'p50 ms':>9}"
            f"{'p99 ms':>9}{'ttft p50':>10}{'cpu s':>7}{'fail':>6}  requests per replica")
    lines = [head, "-" * len(head)]
    for run, r in results.items():
        lines.append(
            f"{run:<15}{r['hit_rate']:>9.1%}{r['client_hit_rate']:>8.1%}{r['output_tok_s']:>11.1f}"
            f"{r['req_s']:>7.2f}{r['p50_ms']:>9.0f}{r['p99_ms']:>9.0f}{r['ttft_p50_ms']:>10.0f}"
            f"{r['engine_cpu_s']:>7.1f}{r['failed']:>6}  "
            + " / ".join(str(x["requests_per_replica"]) for x in r.get("repeats", [r])))
    lines += verdict(results)
    return "\n".join(lines)


def verdict(results: dict[str, dict]) -> list[str]:
    """The issue's acceptance checks, for the runs that were made."""
    ours = results.get("ours")
    if ours is None:
        return []
    lines = []
    single = results.get("single_replica")
    if single and single["hit_rate"]:
        ratio = ours["hit_rate"] / single["hit_rate"]
        lines.append(f"ours / single_replica hit rate: {ratio:.1%} "
                     f"({'ok' if ratio >= 0.95 else 'BELOW'} the 95% target)")
    one = results.get("ours_one_ingress")
    if one and one["hit_rate"]:
        lines.append(f"ours (default ingress count) / ours_one_ingress: hit rate "
                     f"{ours['hit_rate'] / one['hit_rate']:.1%}, throughput "
                     f"x{ours['output_tok_s'] / max(one['output_tok_s'], 1e-9):.2f}")
    for other in ("pow2", "ray_prefix"):
        r = results.get(other)
        if r is None:
            continue
        better = ours["hit_rate"] > r["hit_rate"] and ours["output_tok_s"] > r["output_tok_s"]
        lines.append(f"ours vs {other}: hit rate {100 * (ours['hit_rate'] - r['hit_rate']):+.1f} points, "
                     f"throughput x{ours['output_tok_s'] / max(r['output_tok_s'], 1e-9):.2f} "
                     f"({'beats' if better else 'does NOT beat'} it on both)")
    router = ours.get("router")
    if router:
        lines.append(
            f"ours, router counters: {router.get('routed_with_match', 0):.0f} routed with a match, "
            f"{router.get('routed_without_match', 0):.0f} without, "
            f"{router.get('overflows', 0):.0f} overflows, {router.get('load_fallbacks', 0):.0f} "
            f"load fallbacks, {router.get('misroutes', 0):.0f} misroutes (all ingress replicas); "
            f"digest-held tokens at routing "
            f"{router.get('predicted_matched_tokens', 0):.0f} vs actual {router['actual_cached_tokens']:.0f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    resolve_workload(opts)
    runs = [r.strip() for r in opts.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; choose from {RUNS}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray
    from ray import serve

    model = resolve_model(opts.model)
    # The workers' path keeps the driver's: where Ray itself comes from PYTHONPATH (the GPU
    # machine's --target install), a path of ROOT alone hid it from them and serve.start hung.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=max(8, int(opts.replicas * opts.replica_cpus) + 2), include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"
    repeats: dict[str, list[dict]] = {run: [] for run in runs}
    try:
        if opts.warm_run:
            print(f"[{runs[0]}] warm-up run (discarded)", file=sys.stderr, flush=True)
            one_run(runs[0], opts, model, base_url)
        for i in range(opts.repeat):
            for run in runs[i % len(runs):] + runs[:i % len(runs)]:
                print(f"[{run}] starting", file=sys.stderr, flush=True)
                r = one_run(run, opts, model, base_url)
                repeats[run].append(r)
                print(f"[{run}] hit {r['hit_rate']:.1%}, {r['output_tok_s']:.1f} out tok/s, "
                      f"engine cpu {r['engine_cpu_s']:.1f}s, per replica {r['requests_per_replica']}, "
                      f"{sum(p['on_own_stream'] for p in r['per_replica'])} without a channel "
                      f"(startup {r['startup_s']:.0f}s, run {r['duration_s']:.1f}s)",
                      file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    results = {run: summarize(rs) for run, rs in repeats.items()}
    repeat = f", median of {opts.repeat} runs each" if opts.repeat > 1 else ""
    arrival = (f"at most {opts.concurrency} in flight" if opts.concurrency
               else f"all {opts.groups * opts.per_group} sent at once")
    workload = (f"{opts.groups} groups x {opts.per_group} requests, {opts.system_len}-token shared "
                f"prefix + {opts.question_len}-token question, {opts.output_len} output tokens "
                f"(ignore_eos), {arrival}, {opts.replicas} replicas, workload {opts.workload}, "
                f"ingress {opts.ingress_replicas or 'default'}, serve mode "
                f"{'HAProxy' if os.environ.get('RAY_SERVE_ENABLE_HA_PROXY') == '1' else 'default'}, "
                f"model {opts.model}, {opts.max_total_tokens} KV slots per replica (single replica: "
                f"{opts.max_total_tokens * (opts.replicas if opts.single_kv == 'aggregate' else 1)})"
                f"{repeat}")
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  {workload}")
    print(format_table(results, opts))
    if opts.json_path:
        out = dict(results)
        out["config"] = {**vars(opts), "workload": workload}
        with open(opts.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
