"""W2 through AsyncEngine in one process: the engine thread plus an event loop consuming
every stream, as in an engine replica, but without Ray. Separates what the engine thread
loses to the consumer (the GIL) from what the Ray/HTTP hops cost.

    python scripts/bench_async_path.py [--switch-ms 5 0.5] [--model demo] [--process]
        [--streams 256 --out-tokens 64]

For each GIL switch interval (`sys.setswitchinterval`) it runs W2's shape (all requests at
once) through `AsyncEngine.stream_to` in its wire form, as the replica's delta channels
take them, and prints output tok/s, mean TPOT, TTFT p50 and the engine's mean step (wall
time / steps) beside the offline loop's. `--process` adds a row for ProcessAsyncEngine
(the engine's step loop in a child process, as the `engine_process` app arg runs it),
measured last, after the in-process engine is released (on a GPU both would not fit).
With `--model demo`, `--streams` / `--out-tokens` set the scaled-down workload's size.
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
from engine import AsyncEngine, ProcessAsyncEngine, SamplingParams  # noqa: E402


def workload(small: bool, streams: int = 24, out_tokens: int = 8):
    reqs = bench_offline.w2()
    if small:  # the CPU smoke run: W2's shape, scaled down
        reqs = [([t % 700 + 20 for t in ids[-40:]], out_tokens) for ids, _ in reqs[:streams]]
    return reqs


async def run_async(aengine, reqs) -> dict:
    """All requests at once through `aengine` (AsyncEngine or ProcessAsyncEngine)."""
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

    steps = (await aengine.stats())["steps"]
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i, ids, n) for i, (ids, n) in enumerate(reqs)])
    wall = time.perf_counter() - t0
    steps = (await aengine.stats())["steps"] - steps
    tokens = sum(n for _, n in reqs)
    ttfts.sort()
    return {"output_tok_s": tokens / wall, "wall_s": wall, "step_ms": 1e3 * wall / max(1, steps),
            "tpot_ms": 1e3 * sum(tpots) / max(1, len(tpots)),
            "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2]}


def run_in_thread(engine, reqs) -> dict:
    aengine = AsyncEngine(engine.config, engine, detokenize=False)
    try:
        return asyncio.run(run_async(aengine, reqs))
    finally:
        aengine.shutdown()


def run_in_process(config, reqs) -> dict:
    """ProcessAsyncEngine on the same config: warmed up on a few requests, then measured."""
    aengine = ProcessAsyncEngine(config)
    try:
        asyncio.run(run_async(aengine, reqs[:8]))
        asyncio.run(aengine.flush_cache())
        return asyncio.run(run_async(aengine, reqs))
    finally:
        aengine.shutdown()


def make(model: str):
    if model == "demo":
        from engine import Engine, EngineConfig
        from engine.demo_model import ensure_demo_model

        return Engine(EngineConfig(model=ensure_demo_model(), device="cpu", max_model_len=4096,
                                   max_running_requests=1024))
    return bench_offline.make_engine(bench_offline.model_dir())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 0.5])
    p.add_argument("--model", default="llama3-8b", choices=["llama3-8b", "demo"])
    p.add_argument("--process", action="store_true", help="add the ProcessAsyncEngine row")
    p.add_argument("--streams", type=int, default=24, help="demo model: concurrent requests")
    p.add_argument("--out-tokens", type=int, default=8, help="demo model: output tokens each")
    args = p.parse_args()
    small = args.model == "demo"
    engine = make(args.model)
    reqs = workload(small, args.streams, args.out_tokens)
    bench_offline.run_requests(engine, reqs[:8], "warm")
    engine.flush_cache()
    rows = []
    offline = bench_offline.run_requests(engine, reqs, "off")
    rows.append(("offline loop", offline["output_tokens"] / offline["wall_s"], None, None,
                 1e3 * offline["wall_s"] / max(1, offline["steps"])))
    for ms in args.switch_ms:
        engine.flush_cache()
        sys.setswitchinterval(ms / 1e3)
        r = run_in_thread(engine, reqs)
        rows.append((f"AsyncEngine, switch {ms} ms", r["output_tok_s"], r["tpot_ms"], r["ttft_p50_ms"],
                     r["step_ms"]))
    sys.setswitchinterval(0.005)
    if args.process:
        config = engine.config
        del engine  # the child builds its own: on a GPU the two would not fit
        release_memory()
        r = run_in_process(config, reqs)
        rows.append(("ProcessAsyncEngine", r["output_tok_s"], r["tpot_ms"], r["ttft_p50_ms"], r["step_ms"]))
    print(f"\n{len(reqs)} requests, {sum(n for _, n in reqs)} output tokens")
    print(f"{'path':<28} {'out tok/s':>10} {'TPOT ms':>8} {'TTFT p50 ms':>12} {'ms/step':>8}")
    for name, tok_s, tpot, ttft, step in rows:
        print(f"{name:<28} {tok_s:>10.0f} {_num(tpot):>8.2f} {_num(ttft):>12.1f} {step:>8.2f}")


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


def release_memory() -> None:
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # What this process still holds: the child's pool is sized from what is free.
        print(f"parent GPU memory after release: {torch.cuda.memory_reserved() / 2**30:.2f} GiB "
              f"reserved, {torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free", flush=True)


if __name__ == "__main__":
    main()
