#!/usr/bin/env python
"""O1, the steady stream: Poisson arrivals at a sweep of rates, through HTTP and into the
offline engine in-process, with the same arrival times and prompts (../shared/BENCHMARKS.md).

    # the offline engine (8B-shaped dummy model on a GPU; the demo model with --model demo)
    python scripts/bench_online.py offline --rates 16,32 --json off.json
    # the same arrivals through a running server
    python scripts/bench_online.py http --rates 16,32 --json http.json
    # one table of both, with HTTP/offline ratios
    python scripts/bench_online.py report off.json http.json

Per rate: TTFT p50/p99, TPOT p50/p99 (time per output token after the first, tokens counted
from `usage` through HTTP), ITL p99 and goodput (requests/s meeting TTFT <= 200 ms and
TPOT <= 30 ms). Mixes: `fixed` (512 prompt tokens, 128 output tokens) and `longtail`
(lognormal lengths: prompt median 600, output median 200, sigma 0.8, clipped).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import percentile  # noqa: E402

TTFT_SLO_S = 0.200
TPOT_SLO_S = 0.030
TOKEN_LOW, TOKEN_HIGH = 100, 120000


@dataclass
class Arrival:
    at: float  # seconds after the run's start
    prompt: list[int]
    max_tokens: int


@dataclass
class Timing:
    """One request as its client saw it (times in seconds from its arrival)."""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive deliveries
    error: str = ""


# -- the workload ------------------------------------------------------------------------

def arrivals(rate: float, duration: float, mix: str, seed: int, max_context: int,
             scale: float = 1.0) -> list[Arrival]:
    rng = random.Random(seed * 1000 + int(rate * 10))
    out, t = [], rng.expovariate(rate)
    while t < duration:
        n_in, n_out = (max(4, int(n * scale)) for n in lengths(mix, rng))
        n_in = min(n_in, max_context - n_out)
        out.append(Arrival(t, [rng.randint(TOKEN_LOW, TOKEN_HIGH) for _ in range(n_in)], n_out))
        t += rng.expovariate(rate)
    return out


def lengths(mix: str, rng: random.Random) -> tuple[int, int]:
    if mix == "fixed":
        return 512, 128
    n_in = int(min(4096, max(16, rng.lognormvariate(math.log(600), 0.8))))
    n_out = int(min(1024, max(8, rng.lognormvariate(math.log(200), 0.8))))
    return n_in, n_out


def scaled_prompts(workload: list[Arrival], vocab: int) -> list[Arrival]:
    """The demo model's small vocabulary: the same ids folded into it."""
    return [Arrival(a.at, [100 + t % (vocab - 100) for t in a.prompt], a.max_tokens)
            for a in workload]


# -- the offline engine ------------------------------------------------------------------

def run_offline(engine, workload: list[Arrival]) -> tuple[list[Timing], float]:
    """Each request is added when its time comes; the engine steps in between."""
    from engine import SamplingParams

    timings = [Timing() for _ in workload]
    first, last = [0.0] * len(workload), [0.0] * len(workload)
    index: dict[str, int] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(workload) or engine.has_work:
        now = time.perf_counter() - start
        while nxt < len(workload) and workload[nxt].at <= now:
            a = workload[nxt]
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"o{nxt}", a.prompt, params)
            index[f"o{nxt}"] = nxt
            nxt += 1
        if not engine.has_work:
            time.sleep(max(0.0, workload[nxt].at - (time.perf_counter() - start)))
            continue
        updates = engine.step()
        now = time.perf_counter() - start
        for u in updates:
            if not u.new_tokens:
                continue
            i = index[u.req.request_id]
            t, a = timings[i], workload[i]
            if t.output_tokens == 0:
                t.ttft, first[i] = now - a.at, now
            else:
                t.gaps.append(now - last[i])
            t.output_tokens += len(u.new_tokens)
            last[i] = now
            if u.finished:
                t.latency = now - a.at
                engine.requests.pop(u.req.request_id, None)
    return timings, time.perf_counter() - start


def offline_engine(model: str, overrides: dict):
    import bench_offline
    path = bench_offline.model_dir(model)
    engine = bench_offline.make_engine(path, **overrides)
    return engine, engine.runner.vocab_size, engine.max_context


def warm_offline(engine, vocab: int) -> None:
    """Both step kinds at several batch sizes before any timing."""
    from engine import SamplingParams
    rng = random.Random(7)
    for n in (1, 8, 32):
        for j in range(n):
            prompt = [rng.randint(100, vocab - 1) for _ in range(64)]
            engine.add_request(f"w{n}-{j}", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_work:
            for u in engine.step():
                if u.finished:
                    engine.requests.pop(u.req.request_id, None)


def reference_figures(engine, vocab: int, prompt_len: int = 512) -> dict:
    """What the targets compare with: a batch-1 TTFT of a `prompt_len`-token prompt, and a
    pure decode step (no prefill in it) at several batch sizes."""
    from engine import SamplingParams
    rng = random.Random(11)
    ttfts = []
    for i in range(5):
        prompt = [rng.randint(100, vocab - 1) for _ in range(prompt_len)]
        start = time.perf_counter()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_work:
            for u in engine.step():
                if u.finished:
                    engine.requests.pop(u.req.request_id, None)
        ttfts.append(time.perf_counter() - start)
    out = {"batch1_ttft_ms": 1e3 * percentile(ttfts, 50)}
    for batch in (16, 32, 48, 64):
        out[f"decode_step_ms_b{batch}"] = decode_step_ms(engine, vocab, batch, rng, prompt_len)
    return out


def decode_step_ms(engine, vocab: int, batch: int, rng: random.Random, prompt_len: int,
                   steps: int = 30) -> float:
    from engine import SamplingParams
    params = SamplingParams(max_tokens=steps + 20, ignore_eos=True)
    for j in range(batch):
        engine.add_request(f"d{batch}-{j}", [rng.randint(100, vocab - 1) for _ in range(prompt_len)], params)
    for _ in range(10):  # past every prefill
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_work:
        for u in engine.step():
            if u.finished:
                engine.requests.pop(u.req.request_id, None)
    return 1e3 * elapsed / steps


# -- through HTTP ------------------------------------------------------------------------

async def run_http(base_url: str, model: str, workload: list[Arrival]) -> tuple[list[Timing], float]:
    import aiohttp
    url = base_url.rstrip("/") + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def one(a: Arrival) -> Timing:
            await asyncio.sleep(max(0.0, a.at - (time.perf_counter() - start)))
            return await stream_one(session, url, model, a, start + a.at)

        timings = await asyncio.gather(*(one(a) for a in workload))
        return list(timings), time.perf_counter() - start


async def stream_one(session, url: str, model: str, a: Arrival, arrived: float) -> Timing:
    t = Timing()
    body = {"model": model, "prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    last = arrived
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return t
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if chunk.get("error"):
                    t.error = json.dumps(chunk["error"])[:200]
                    return t
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if t.ttft == 0.0:
                        t.ttft = now - arrived
                    else:
                        t.gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        t.error = f"{type(e).__name__}: {e}"
        return t
    t.latency = time.perf_counter() - arrived
    if not t.output_tokens:
        t.error = "no usage in the stream"
    return t


async def served_model(base_url: str) -> tuple[str, int | None]:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
            data = (await resp.json())["data"][0]
    return data["id"], data.get("max_model_len")


def engine_steps(args, engine) -> int:
    """Steps the engine (all replicas) has run so far: what a run's step rate comes from."""
    if engine is not None:
        return engine.stats()["steps"]
    import urllib.request
    with urllib.request.urlopen(args.base_url.rstrip("/") + "/v1/stats", timeout=30) as resp:
        return json.loads(resp.read()).get("steps", 0)


# -- figures -----------------------------------------------------------------------------

def summarize(rate: float, timings: list[Timing], duration: float) -> dict:
    ok = [t for t in timings if not t.error]
    tpot = [(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    good = [t for t in ok if t.ttft <= TTFT_SLO_S and t.output_tokens > 1
            and (t.latency - t.ttft) / (t.output_tokens - 1) <= TPOT_SLO_S]
    ms = lambda xs, q: 1e3 * percentile(xs, q)  # noqa: E731
    return {
        "rate": rate, "requests": len(timings), "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:3],
        "ttft_p50": ms([t.ttft for t in ok], 50), "ttft_p99": ms([t.ttft for t in ok], 99),
        "tpot_p50": ms(tpot, 50), "tpot_p99": ms(tpot, 99),
        "itl_p99": ms([g for t in ok for g in t.gaps], 99),
        "goodput": len(good) / duration, "duration_s": duration,
        "output_tok_s": sum(t.output_tokens for t in ok) / duration,
    }


COLUMNS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99", "goodput", "ms_per_step")


def table(runs: dict[str, dict]) -> str:
    """Rows per (mix, rate): each run's figures, and each later run's ratio to the first
    (the offline engine, when `report` is given its file first)."""
    names = list(runs)
    head = f"{'mix':<9}{'rate':>5}  {'run':<10}" + "".join(f"{c:>12}" for c in COLUMNS) + f"{'fail':>6}"
    lines = [head, "-" * len(head)]
    keys = sorted({(m["mix"], m["rate"]) for r in runs.values() for m in r["rows"]})
    for mix, rate in keys:
        rows = {n: next((m for m in runs[n]["rows"] if (m["mix"], m["rate"]) == (mix, rate)), None)
                for n in names}
        for n, m in rows.items():
            if m:
                lines.append(f"{mix:<9}{rate:>5g}  {n[:10]:<10}" + "".join(f"{m[c]:>12.2f}" for c in COLUMNS)
                             + f"{m['failed']:>6}")
        base = rows[names[0]]
        for n in names[1:]:
            if base and rows[n]:
                ratio = [rows[n][c] / base[c] if base[c] else float("nan") for c in COLUMNS]
                label = f"{n[:4]}/{names[0][:4]}"
                lines.append(f"{mix:<9}{rate:>5g}  {label:<10}" + "".join(f"{x:>12.2f}" for x in ratio))
    return "\n".join(lines)


# -- the command line --------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", choices=["offline", "http", "report"])
    p.add_argument("files", nargs="*", help="report: the runs' JSON files (offline first)")
    p.add_argument("--rates", default="8,16,32,48")
    p.add_argument("--mixes", default="fixed,longtail")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every prompt and output length (smoke runs on a CPU)")
    p.add_argument("--model", default="llama3-8b", help="offline: bench_offline's model name (or demo)")
    p.add_argument("--engine", nargs="*", default=[], help="offline: EngineConfig KEY=VALUE overrides")
    p.add_argument("--reference", action="store_true",
                   help="offline: also a batch-1 TTFT and pure decode steps at batch 16-64")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--vocab", type=int, default=0,
                   help="http: fold prompt ids into this vocabulary (the demo model's)")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    if args.target == "report":
        runs = {Path(f).stem: json.loads(Path(f).read_text()) for f in args.files}
        print(table(runs))
        for name, run in runs.items():
            if "reference" in run:
                print(f"{name} reference: " + ", ".join(f"{k} {v:.2f}" for k, v in run["reference"].items()))
        return
    rates = [float(r) for r in args.rates.split(",")]
    mixes = args.mixes.split(",")
    result = {"target": args.target}
    result["rows"] = run_target(args, rates, mixes, result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    print(table({args.target: result}))
    if "reference" in result:
        print("reference: " + ", ".join(f"{k} {v:.2f}" for k, v in result["reference"].items()))


def run_target(args, rates: list[float], mixes: list[str], result: dict) -> list[dict]:
    rows = []
    if args.target == "offline":
        import bench_offline
        engine, vocab, max_context = offline_engine(args.model, bench_offline.parse_overrides(args.engine))
        warm_offline(engine, vocab)
        if args.reference:
            result["reference"] = reference_figures(engine, vocab, min(512, max_context // 4))
    else:
        model, max_context = asyncio.run(served_model(args.base_url))
        vocab, max_context = args.vocab, max_context or 4096
        warm = [Arrival(0.0, [TOKEN_LOW + i + j for j in range(64)], 8) for i in range(16)]
        asyncio.run(run_http(args.base_url, model, scaled_prompts(warm, vocab) if vocab else warm))
    for mix in mixes:
        for rate in rates:
            workload = arrivals(rate, args.duration, mix, args.seed, max_context, args.length_scale)
            if vocab and vocab < TOKEN_HIGH:
                workload = scaled_prompts(workload, vocab)
            steps = engine_steps(args, engine if args.target == "offline" else None)
            if args.target == "offline":
                timings, duration = run_offline(engine, workload)
            else:
                timings, duration = asyncio.run(run_http(args.base_url, model, workload))
            steps = engine_steps(args, engine if args.target == "offline" else None) - steps
            row = {"mix": mix, **summarize(rate, timings, duration), "steps": steps,
                   "ms_per_step": 1e3 * duration / max(1, steps)}
            print(f"{args.target} {mix} {rate:g}/s: {row['requests']} requests, TTFT p50 "
                  f"{row['ttft_p50']:.1f} ms, TPOT p50 {row['tpot_p50']:.2f} ms", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
