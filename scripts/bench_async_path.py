"""W2 through AsyncEngine in one process: the engine thread plus an event loop consuming
every stream, as in an engine replica, but without Ray. Separates what the engine thread
loses to the consumer (the GIL) from what the Ray/HTTP hops cost.

    python scripts/bench_async_path.py [--switch-ms 5 0.5] [--model demo]

For each GIL switch interval (`sys.setswitchinterval`) it runs W2's shape (all requests at
once) through `AsyncEngine.stream_to` in its wire form, as the replica's delta channels
take them, and prints output tok/s, mean TPOT and TTFT p50 beside the offline loop's.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import bench_offline  # noqa: E402
from engine import AsyncEngine, SamplingParams  # noqa: E402


def workload(small: bool):
    reqs = bench_offline.w2()
    if small:  # the CPU smoke run: W2's shape, scaled down
        reqs = [([t % 700 + 20 for t in ids[-40:]], 8) for ids, _ in reqs[:24]]
    return reqs


async def run_async(engine, reqs) -> dict:
    aengine = AsyncEngine(engine.config, engine, detokenize=False)
    ttfts, tpots, out = [], [], []

    async def one(i, ids, n_out):
        start = time.perf_counter()
        first = last = None

        def put(delta):
            nonlocal first, last
            out.append(delta)  # what the replica does with a WireDelta: into the channel's batch
            last = time.perf_counter()
            if first is None:
                first = last

        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        await aengine.stream_to(ids, params, f"a{i}", put, wire=True)
        ttfts.append(first - start)
        if n_out > 1:
            tpots.append((last - first) / (n_out - 1))

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i, ids, n) for i, (ids, n) in enumerate(reqs)])
    wall = time.perf_counter() - t0
    aengine.shutdown()
    tokens = sum(n for _, n in reqs)
    ttfts.sort()
    return {"output_tok_s": tokens / wall, "wall_s": wall,
            "tpot_ms": 1e3 * sum(tpots) / max(1, len(tpots)),
            "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2]}


def make(model: str):
    if model == "demo":
        from engine import Engine, EngineConfig
        from engine.demo_model import ensure_demo_model

        return Engine(EngineConfig(model=ensure_demo_model(), device="cpu", max_model_len=4096))
    return bench_offline.make_engine(bench_offline.model_dir())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 0.5])
    p.add_argument("--model", default="llama3-8b", choices=["llama3-8b", "demo"])
    args = p.parse_args()
    small = args.model == "demo"
    engine = make(args.model)
    reqs = workload(small)
    bench_offline.run_requests(engine, reqs[:8], "warm")
    engine.flush_cache()
    rows = []
    offline = bench_offline.run_requests(engine, reqs, "off")
    rows.append(("offline loop", offline["output_tokens"] / offline["wall_s"], None, None))
    for ms in args.switch_ms:
        engine.flush_cache()
        sys.setswitchinterval(ms / 1e3)
        r = asyncio.run(run_async(engine, reqs))
        rows.append((f"AsyncEngine, switch {ms} ms", r["output_tok_s"], r["tpot_ms"], r["ttft_p50_ms"]))
    sys.setswitchinterval(0.005)
    print(f"\n{'path':<28} {'out tok/s':>10} {'TPOT ms':>8} {'TTFT p50 ms':>12}")
    for name, tok_s, tpot, ttft in rows:
        print(f"{name:<28} {tok_s:>10.0f} {tpot if tpot is not None else float('nan'):>8.2f} "
              f"{ttft if ttft is not None else float('nan'):>12.1f}")


if __name__ == "__main__":
    main()
