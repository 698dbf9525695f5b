"""TTFT of a returning conversation whose history another engine replica holds: fetched
from that replica through Ray's object store (deployments/prefix_fetch.py) against computed
again. Two engine replicas share one GPU (0.5 each) behind the Serve app (HTTP, the prefix
router); the Llama-3-8B-shaped dummy model (or the demo model: a CPU smoke run).

    python scripts/bench_prefix_fetch.py                          # GPU: an 8k-token history
    python scripts/bench_prefix_fetch.py --model demo --history 256 --reps 2   # CPU smoke
    PARTS=fetch bash scripts/gpu_serve_check.sh                   # on the GPU machine

Each repetition: the history is computed on one replica (the holder); a long request then
keeps the holder busy, so the router sends the returning conversation (history + a new
turn) to the other replica and names the holder, and that replica fetches the history
before its prefill. "computed" is the same with no replica holding the history (another
replica kept busy the same way, so both rows share the GPU alike). TTFT is the first
streamed token over HTTP; the median of `--reps`. Prints a table; `--json PATH` writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_offline import DEMO, LONG_MAX_POSITIONS, model_config, model_dir, random_prompt  # noqa: E402
from serve_replicas import call_each, holds_prefix, list_replicas, routing_stats  # noqa: E402

BASE = "http://127.0.0.1:8000"  # --port sets it
MODEL_NAME = "bench"
CONTEXT = {"tokens": 512}  # the model's context (max_position_embeddings), set in main


def app_args(args, path: str, gpu: bool) -> dict:
    engine = {"max_total_tokens": 4 * args.history, "chunked_prefill_size": 8192,
              "host_kv_cache_gb": args.host_gb, "max_running_requests": 8}
    if args.model != DEMO:
        engine.update(load_format="dummy", dtype="bfloat16", grammar_backend="none")
    return {"model": path, "served_model_name": MODEL_NAME, "num_replicas": 2, "ingress_replicas": 1,
            "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.5} if gpu else {"num_cpus": 0.5},
            "engine": engine,
            # a replica with a request in flight beside an idle one overflows to the idle one
            "router": {"request_router_class": "prefix", "request_routing_stats_period_s": 0.2,
                       "request_router_kwargs": {"block_size": 16, "abs_threshold": 0,
                                                 "rel_threshold": 1.0}}}


def post(ids: list[int], max_tokens: int = 1) -> None:
    r = httpx.post(f"{BASE}/v1/completions", timeout=600, json={
        "model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()


def ttft_s(ids: list[int]) -> float:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}
    began = time.perf_counter()
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - began
    raise RuntimeError("the stream ended without a token")


class Busy:
    """A long streamed request, left (so aborted) when the block ends."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.stop = ids, threading.Event()
        self.max_tokens = min(4000, CONTEXT["tokens"] - len(ids) - 1)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": self.ids, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=600) as r:
            for _ in r.iter_lines():
                if self.stop.is_set():
                    return

    def __enter__(self) -> Busy:
        self.thread.start()
        time.sleep(0.5)  # routed first
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


def holder_of(prefix: list[int], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [r for r, yes in holds_prefix(routing_stats(replicas()), prefix).items() if yes]
        if len(held) == 1:
            time.sleep(1.0)  # five routing-stats periods: the router has the digest
            return held[0]
        time.sleep(0.2)
    raise RuntimeError("no single replica holds the history")


def replicas() -> dict:
    return list_replicas("radixserve", "EngineReplica")


def fetch_counters() -> dict[str, int]:
    return {r: s["prefix_fetched_tokens"] for r, s in call_each(replicas(), "stats").items()}


def repetition(rng: random.Random, vocab: int, n: int) -> dict:
    httpx.post(f"{BASE}/flush_cache", timeout=60).raise_for_status()
    history = random_prompt(rng, vocab, n)
    post(history)
    holder = holder_of(history[:n - n % 16])
    before = fetch_counters()
    with Busy(history + random_prompt(rng, vocab, 16)):
        fetched = ttft_s(history + random_prompt(rng, vocab, 32))
    after = fetch_counters()
    other = next(r for r in after if r != holder)
    got = after[other] - before[other]
    if got < n - 16:
        raise RuntimeError(f"the other replica fetched {got} of {n} history tokens")
    httpx.post(f"{BASE}/flush_cache", timeout=60).raise_for_status()
    with Busy(random_prompt(rng, vocab, 64)):
        computed = ttft_s(random_prompt(rng, vocab, n + 32))
    if fetch_counters() != after:
        raise RuntimeError("the computed row fetched")
    return {"fetched_s": fetched, "computed_s": computed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=["llama3-8b", DEMO])
    ap.add_argument("--history", type=int, default=8192)
    ap.add_argument("--host-gb", type=float, default=8.0, help="host_kv_cache_gb per replica")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    global BASE
    BASE = f"http://127.0.0.1:{args.port}"
    import ray
    import torch
    from ray import serve

    from deployments.app import build_app
    from dummy_tokenizer import write_word_tokenizer

    gpu = torch.cuda.is_available()
    path = model_dir(args.model, None if args.model == DEMO else LONG_MAX_POSITIONS)
    if args.model != DEMO:
        write_word_tokenizer(path)
    config = model_config(path)
    vocab, CONTEXT["tokens"] = config["vocab_size"], config["max_position_embeddings"]
    pythonpath = os.pathsep.join(p for p in (sys.path[0], os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(app_args(args, path, gpu)), name="radixserve", route_prefix="/")
        rng = random.Random(5)
        repetition(rng, vocab, min(args.history, 256))  # warm-up: compiles, first fetch
        rows = [repetition(rng, vocab, args.history) for _ in range(args.reps)]
    finally:
        serve.shutdown()
        ray.shutdown()
    fetched = statistics.median(r["fetched_s"] for r in rows)
    computed = statistics.median(r["computed_s"] for r in rows)
    print(f"\n| TTFT, {args.history}-token history ({args.model}, {'GPU' if gpu else 'CPU'}, "
          f"2 replicas) | fetched from the other replica | computed | fetched / computed |")
    print("|---|---|---|---|")
    print(f"| median of {len(rows)} | {fetched * 1e3:.1f} ms | {computed * 1e3:.1f} ms | "
          f"{fetched / computed:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "fetched_s": fetched,
                       "computed_s": computed, "ratio": fetched / computed}, f, indent=1)


if __name__ == "__main__":
    main()
