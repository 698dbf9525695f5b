"""What Ray Serve's ingress + deployment handle add per request: the same workload sent
to an AsyncEngine in-process and through HTTP to the Serve app (same engine settings).

    python scripts/bench_http_overhead.py [--num-prompts 64] [--concurrency 8] [--json PATH]
    python scripts/bench_http_overhead.py --hops [--json PATH]

`--hops` splits the overhead by hop on an otherwise idle server: the same 16-token request
(1 and 32 output tokens) in-process, through a Serve deployment handle straight to the
engine replica, over HTTP (proxy -> ingress -> replica), and over HTTP to the same engine
with `ingress: colocated` (proxy -> one replica that is ingress and engine); `GET /v1/models`
for the proxy + ingress alone; and a burst of 64 one-token requests through the handle and
both HTTP paths. Set RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 for the
README's mode (scripts/serve.sh).
Medians of 30 sequential requests after 5 warm-ups.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))

from bench_serving import make_args, run_benchmark  # noqa: E402
from engine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402

ENGINE = {"max_running_requests": 64, "chunked_prefill_size": 512, "max_total_tokens": 16384}
PORT = 8123


def workload(n: int, input_len: int, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randint(3, 700) for _ in range(input_len)] for _ in range(n)]


async def direct(prompts, output_len: int, concurrency: int) -> dict:
    engine = AsyncEngine(EngineConfig(model=ensure_demo_model(), **ENGINE))
    sem = asyncio.Semaphore(concurrency)
    latencies, ttfts = [], []

    async def one(i, ids):
        async with sem:
            t0 = time.perf_counter()
            first = None
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
            async for d in engine.generate(ids, params, request_id=f"d{i}"):
                if first is None and d.token_ids:
                    first = time.perf_counter() - t0
            latencies.append(time.perf_counter() - t0)
            ttfts.append(first)

    await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts[:4])])  # warm-up
    latencies.clear(), ttfts.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i + 100, p) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    engine.shutdown()
    return {"output_tok_s": len(prompts) * output_len / wall, "mean_e2e_ms": 1e3 * _mean(latencies),
            "mean_ttft_ms": 1e3 * _mean(ttfts)}


def through_http(n: int, input_len: int, output_len: int, concurrency: int) -> dict:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    serve.start(http_options={"port": PORT})
    serve.run(build_app({"engine": ENGINE, "ray_actor_options": {"num_cpus": 1}}),
              name="bench", route_prefix="/")
    args = make_args(base_url=f"http://127.0.0.1:{PORT}", num_prompts=n, input_len=input_len,
                     output_len=output_len, max_concurrency=concurrency, token_id_low=3,
                     token_id_high=700, quiet=True, warmup_requests=4)
    result = asyncio.run(run_benchmark(args))
    serve.shutdown()
    ray.shutdown()
    return result


def hops() -> dict:
    """Per-hop latency and a burst (see the module docstring)."""
    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.engine_replica import EngineCall

    r = random.Random(0)
    ids = lambda: [r.randint(3, 700) for _ in range(16)]  # noqa: E731
    out: dict = {}

    engine = AsyncEngine(EngineConfig(model=ensure_demo_model(), **ENGINE))
    for n in (1, 32):
        async def local(n=n):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(ids(), params, request_id=uuid.uuid4().hex):
                pass
        out[f"in_process_{n}"] = asyncio.run(_median_async(local))
    engine.shutdown()

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    serve.start(http_options={"port": PORT})
    serve.run(build_app({"engine": ENGINE, "ray_actor_options": {"num_cpus": 1}}),
              name="bench", route_prefix="/")
    # The same engine with `ingress: colocated` (deployments/colocated.py), beside it.
    serve.run(build_app({"engine": ENGINE, "ray_actor_options": {"num_cpus": 1},
                         "ingress": "colocated"}), name="colocated", route_prefix="/colocated")
    handle = None  # made inside the loop: under RAY_SERVE_THROUGHPUT_OPTIMIZED a handle needs one
    base = f"http://127.0.0.1:{PORT}"

    async def via_handle(n=1):
        call = EngineCall(uuid.uuid4().hex, ids(), {"max_tokens": n, "ignore_eos": True})
        async for _ in handle.generate.remote(call):
            pass

    async def via_http(client, n=1, prefix=""):
        body = {"model": "radixserve-demo", "prompt": ids(), "max_tokens": n, "ignore_eos": True}
        (await client.post(f"{base}{prefix}/v1/completions", json=body)).raise_for_status()

    async def burst(fn, size=64):
        await asyncio.gather(*[fn() for _ in range(8)])
        walls = []
        for _ in range(3):
            t = time.perf_counter()
            await asyncio.gather(*[fn() for _ in range(size)])
            walls.append(1e3 * (time.perf_counter() - t))
        return min(walls)

    async def serve_side():
        nonlocal handle
        handle = serve.get_deployment_handle("EngineReplica", app_name="bench").options(stream=True)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=128)) as c:
            res = {}
            for n in (1, 32):
                res[f"handle_{n}"] = await _median_async(lambda: via_handle(n))
                res[f"http_{n}"] = await _median_async(lambda: via_http(c, n))
                res[f"colocated_{n}"] = await _median_async(lambda: via_http(c, n, "/colocated"))
            res["http_models"] = await _median_async(lambda: c.get(f"{base}/v1/models"))
            res["burst64_handle"] = await burst(via_handle)
            res["burst64_http"] = await burst(lambda: via_http(c))
            res["burst64_colocated"] = await burst(lambda: via_http(c, 1, "/colocated"))
            return res

    out.update(asyncio.run(serve_side()))
    try:
        serve.shutdown()
    except RuntimeError:  # the handle's router loop (the throughput mode's) closed with asyncio.run
        pass
    ray.shutdown()
    return out


async def _median_async(fn, n: int = 30) -> float:
    for _ in range(5):
        await fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def print_hops(h: dict) -> None:
    print(f"\n{'request (16 prompt tokens)':<34} {'in-process':>11} {'handle':>8} {'HTTP':>8} "
          f"{'HTTP colocated':>15}")
    for n in (1, 32):
        print(f"{f'{n} output token(s), median ms':<34} {h[f'in_process_{n}']:>11.1f} "
              f"{h[f'handle_{n}']:>8.1f} {h[f'http_{n}']:>8.1f} {h[f'colocated_{n}']:>15.1f}")
    print(f"{'GET /v1/models, median ms':<34} {'':>11} {'':>8} {h['http_models']:>8.1f}")
    print(f"{'burst of 64 x 1 token, wall ms':<34} {'':>11} {h['burst64_handle']:>8.0f} "
          f"{h['burst64_http']:>8.0f} {h['burst64_colocated']:>15.0f}")


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--hops", action="store_true", help="per-hop latency on an idle server")
    a = ap.parse_args()
    if a.hops:
        h = hops()
        print_hops(h)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(h, f, indent=1)
        return
    prompts = workload(a.num_prompts, a.input_len)
    d = asyncio.run(direct(prompts, a.output_len, a.concurrency))
    h = through_http(a.num_prompts, a.input_len, a.output_len, a.concurrency)
    rows = [("engine in-process", d["output_tok_s"], d["mean_e2e_ms"], d["mean_ttft_ms"]),
            ("HTTP -> Serve ingress -> replica", h.get("output_throughput"),
             h["e2e_ms_mean"], h["ttft_ms_mean"])]
    print(f"\n{'path':<34} {'out tok/s':>10} {'mean e2e ms':>12} {'mean TTFT ms':>13}")
    for name, tps, e2e, ttft in rows:
        print(f"{name:<34} {tps:>10.1f} {e2e:>12.1f} {ttft:>13.1f}")
    print(f"overhead per request: {rows[1][2] - rows[0][2]:.1f} ms e2e, "
          f"{rows[1][3] - rows[0][3]:.1f} ms TTFT")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"direct": d, "http": h}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
