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
before its prefill. "tail" is the same with the receiver holding the history's first half
already (computed there directly): only the second half's KV travels (the bytes column).
"computed" is the same with no replica holding the history (another replica kept busy the
same way, so every row shares the GPU alike). TTFT is the first streamed token over HTTP;
the median of `--reps`. Prints a table; `--json PATH` writes it.
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
from serve_replicas import (  # noqa: E402
    call_each, holds_prefix, list_replicas, routing_stats, stream_replica,
)

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


def fetch_counters() -> dict[str, tuple[int, int]]:
    """{replica: (tokens fetched, bytes fetched)} since it started."""
    return {r: (s["prefix_fetched_tokens"], s["prefix_fetched_bytes"])
            for r, s in call_each(replicas(), "stats").items()}


def compute_on(replica: str, ids: list[int]) -> None:
    """`ids` prefilled on this very replica (no router), so its cache holds them."""
    from deployments.engine_replica import EngineCall
    from engine import SamplingParams

    call = EngineCall(f"seed-{random.getrandbits(32)}", ids, SamplingParams(max_tokens=1))
    stream_replica(replicas()[replica], "generate", call, timeout=600)


def fetched_row(rng: random.Random, vocab: int, history: list[int], held: int) -> dict:
    """TTFT of the history + a new turn on the replica that does not hold it, holding its
    first `held` tokens itself; the tokens and bytes it fetched."""
    n = len(history)
    httpx.post(f"{BASE}/flush_cache", timeout=60).raise_for_status()
    post(history)
    holder = holder_of(history[:n - n % 16])
    other = next(r for r in replicas() if r != holder)
    if held:
        compute_on(other, history[:held])
        time.sleep(1.0)  # five routing-stats periods: the router has the digest
    before = fetch_counters()
    with Busy(history + random_prompt(rng, vocab, 16)):
        ttft = ttft_s(history + random_prompt(rng, vocab, 32))
    after = fetch_counters()
    tokens, nbytes = (a - b for a, b in zip(after[other], before[other]))
    if tokens < n - held - 16 or tokens > n - held:
        raise RuntimeError(f"the other replica fetched {tokens} of the {n - held} history "
                           "tokens it lacked")
    return {"s": ttft, "tokens": tokens, "bytes": nbytes}


def repetition(rng: random.Random, vocab: int, n: int) -> dict:
    history = random_prompt(rng, vocab, n)
    whole = fetched_row(rng, vocab, history, 0)
    tail = fetched_row(rng, vocab, random_prompt(rng, vocab, n), n // 2 - n // 2 % 16)
    after = fetch_counters()
    httpx.post(f"{BASE}/flush_cache", timeout=60).raise_for_status()
    with Busy(random_prompt(rng, vocab, 64)):
        computed = ttft_s(random_prompt(rng, vocab, n + 32))
    if fetch_counters() != after:
        raise RuntimeError("the computed row fetched")
    return {"fetched_s": whole["s"], "fetched_bytes": whole["bytes"], "tail_s": tail["s"],
            "tail_bytes": tail["bytes"], "computed_s": computed}


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
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    fetched, tail, computed = med["fetched_s"], med["tail_s"], med["computed_s"]
    print(f"\n| TTFT, {args.history}-token history ({args.model}, {'GPU' if gpu else 'CPU'}, "
          "2 replicas), median of " f"{len(rows)} | TTFT | / computed | KV fetched |")
    print("|---|---|---|---|")
    for label, key, nbytes in (("fetched from the other replica", "fetched_s", med["fetched_bytes"]),
                               ("the same, the receiver holding the first half", "tail_s",
                                med["tail_bytes"]),
                               ("computed", "computed_s", 0)):
        print(f"| {label} | {med[key] * 1e3:.1f} ms | {med[key] / computed:.3f} | "
              f"{nbytes / 2**10:.0f} KiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "fetched_s": fetched, "tail_s": tail,
                       "computed_s": computed, "ratio": fetched / computed}, f, indent=1)


if __name__ == "__main__":
    main()
