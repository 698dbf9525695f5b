"""The host KV tier (`host_kv_cache_gb`) on the offline engine, against the same engine
without it, on the Llama-3-8B-shaped dummy model (or the demo model: a CPU smoke run).

    python scripts/bench_host_tier.py                     # GPU: the issue's workload
    python scripts/bench_host_tier.py --model demo --conversations 6 --first 40 \\
        --answer 4 --user 8 --turns 3 --ttft-tokens 200   # CPU smoke

1. Multi-turn chat whose live history is `--history-over-pool` (4) times the KV pool:
   `conversations` users, each turn every user sends `user` more tokens after the last
   answer (`first` tokens at turn 1) and gets `answer` tokens back. As in W4, each turn is
   one batch of every conversation; the scheduler admits what the pool holds, so most
   returning conversations find their history evicted from the GPU (`--wave N`: batches
   of N users instead, a decode-bound shape at small N). Rows: host tier off, on, and an
   unlimited pool (the hit rate to compare with: everything but the new message cached). Turn throughput and prefix hit rate, and where
   each run's time went: prefill and decode forwards, the host's share, the tier's copies.
2. TTFT of a returning conversation with a `ttft_tokens` history: loaded from the host
   (the GPU's cache evicted to the host, as other conversations would push it out)
   against recomputed (cache flushed); the median of `--reps`.
3. Host<->device bandwidth the tier's copies reached (bytes / copy time on their stream)
   against the link's measured peak (one large pinned copy each way).
4. With `--replica-fetch`: the same returning conversation fetched from another replica
   (two at 0.5 GPU each, through Ray Serve) against computed: scripts/bench_prefix_fetch.py
   in a process of its own (it needs Ray Serve), its row added to the table.
Prints a table; `--json PATH` writes the rows.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_offline import (  # noqa: E402
    DEMO, LONG_MAX_POSITIONS, StepPhases, model_config, model_dir, random_prompt)

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.loading.demo_model import ensure_demo_model  # noqa: E402

GPU = torch.cuda.is_available()


def make_llm(args, pool: int, host_gb: float) -> LLM:
    path = model_dir(args.model, None if args.model == DEMO else LONG_MAX_POSITIONS)
    extra = {} if args.model == DEMO else dict(load_format="dummy", dtype="bfloat16",
                                               tokenizer=ensure_demo_model())
    return LLM(model=path, max_total_tokens=pool, host_kv_cache_gb=host_gb,
               chunked_prefill_size=args.chunk, **extra)


def conversation_workload(args, llm: LLM) -> dict:
    """All turns of all conversations, `args.wave` users a batch (0: all of them)."""
    rng = random.Random(4)
    vocab = llm.engine.runner.vocab_size
    history = [random_prompt(rng, vocab, args.first) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    before = llm.stats()
    phases = StepPhases(llm.engine)
    began, turns = time.perf_counter(), 0
    for turn in range(args.turns):
        wave = args.wave or args.conversations
        for w in range(0, args.conversations, wave):
            outs = llm.generate(history[w:w + wave], params)
            for i, out in enumerate(outs, start=w):
                history[i] = history[i] + out.token_ids + random_prompt(rng, vocab, args.user)
            turns += len(outs)
    wall = time.perf_counter() - began
    split = phases.summary(wall)
    phases.close()
    after = llm.stats()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {"wall_s": wall, "turns_per_s": turns / wall, "hit_rate": cached / prompt,
            "host_hit_tokens": after["host_cached_tokens"] - before["host_cached_tokens"],
            "final_history_tokens": sum(map(len, history)),
            "decode_s": split["decode"]["gpu_s"], "prefill_s": split["prefill_or_mixed"]["gpu_s"],
            "prefill_tokens": split["prefill_or_mixed"]["tokens"], "other_s": split["other_s"],
            "host_load_s": after.get("host_load_seconds", 0.0) - before.get("host_load_seconds", 0.0),
            "host_write_back_s": (after.get("host_write_back_seconds", 0.0)
                                  - before.get("host_write_back_seconds", 0.0))}


def history_tokens(args) -> int:
    """Live history at the last turn: what the pool is sized against."""
    per = args.first + (args.turns - 1) * (args.answer + args.user) + args.answer
    return args.conversations * per


def ttft_rows(args, llm: LLM) -> dict:
    rng = random.Random(7)
    vocab = llm.engine.runner.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    host, fresh = [], []
    for _ in range(args.reps):
        conv = random_prompt(rng, vocab, args.ttft_tokens)
        prompt = conv + random_prompt(rng, vocab, 32)
        llm.engine.flush_cache()
        llm.generate([conv], one)
        cache = llm.engine.cache
        cache.evict(cache.evictable_size)  # as other conversations would: all of it to the host
        loaded = llm.stats()["host_cached_tokens"]
        _sync()
        began = time.perf_counter()
        llm.generate([prompt], one)
        _sync()
        host.append(time.perf_counter() - began)
        assert llm.stats()["host_cached_tokens"] - loaded == args.ttft_tokens, \
            "the returning conversation did not come from the host"
        llm.engine.flush_cache()
        _sync()
        began = time.perf_counter()
        llm.generate([prompt], one)
        _sync()
        fresh.append(time.perf_counter() - began)
    h, f = statistics.median(host), statistics.median(fresh)
    return {"ttft_host_s": h, "ttft_recompute_s": f, "host_over_recompute": h / f}


def link_peak_gb_s() -> dict:
    """One 1 GiB pinned copy each way (a 16 MiB CPU memcpy on a CPU run)."""
    n = (2**30 if GPU else 2**24) // 2
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=GPU)
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda" if GPU else "cpu")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)
        _sync()
        began = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        _sync()
        out[name] = 5 * n * 2 / (time.perf_counter() - began) / 1e9
    return out


def _sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=["llama3-8b", DEMO])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=1024)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--user", type=int, default=256)
    ap.add_argument("--history-over-pool", type=float, default=4.0)
    ap.add_argument("--wave", type=int, default=0,
                    help="conversations per batch within a turn (default: all of them)")
    ap.add_argument("--chunk", type=int, default=8192, help="chunked_prefill_size")
    ap.add_argument("--host-gb", type=float, default=None,
                    help="host_kv_cache_gb (default: twice the history's KV)")
    ap.add_argument("--ttft-tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replica-fetch", action="store_true",
                    help="add the fetched-from-another-replica row (Ray Serve)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pool = int(history_tokens(args) / args.history_over_pool)
    cfg = model_config(model_dir(args.model))
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    token_bytes = 2 * cfg["num_hidden_layers"] * kv_heads * cfg["head_dim"] * (2 if GPU else 4)
    host_gb = args.host_gb or 2 * history_tokens(args) * token_bytes / 2**30
    print(f"history {history_tokens(args)} tokens, pool {pool}, "
          f"batches of {args.wave or args.conversations} conversations, "
          f"host tier {host_gb:.2f} GiB", flush=True)
    rows = {}
    for name, size, gb in (("host tier off", pool, 0.0), ("host tier on", pool, host_gb),
                           ("unlimited pool", 2 * history_tokens(args), 0.0)):
        llm = make_llm(args, size, gb)
        rows[name] = conversation_workload(args, llm)
        print(name, rows[name], flush=True)
        del llm
        _free()
    ttft_pool = args.ttft_tokens + 128
    gb = max(host_gb, 3 * args.ttft_tokens * token_bytes / 2**30)
    llm = make_llm(args, ttft_pool, gb)
    ttft = ttft_rows(args, llm)
    stats = llm.stats()
    reached = {"h2d": stats["host_load_bytes"] / stats["host_load_seconds"] / 1e9,
               "d2h": stats["host_write_back_bytes"] / stats["host_write_back_seconds"] / 1e9}
    peak = link_peak_gb_s()
    del llm
    _free()
    fetch = replica_fetch(args) if args.replica_fetch else None
    off, on, full = rows["host tier off"], rows["host tier on"], rows["unlimited pool"]
    print(f"\n| workload ({args.model}, {'GPU' if GPU else 'CPU'}) | tier off | tier on | unlimited |")
    print("|---|---|---|---|")
    print(f"| turns/s | {off['turns_per_s']:.2f} | {on['turns_per_s']:.2f} | {full['turns_per_s']:.2f} |")
    print(f"| prefix hit rate | {off['hit_rate']:.3f} | {on['hit_rate']:.3f} | {full['hit_rate']:.3f} |")
    # Where each run's wall time went: forward passes (device time) by kind, the rest on the
    # host (scheduling, sampling, waits), and the tier's copy time on its own stream.
    for key, label in (("wall_s", "wall s"), ("prefill_s", "prefill/mixed forwards s"),
                       ("prefill_tokens", "tokens in those forwards"), ("decode_s", "decode forwards s"),
                       ("other_s", "outside forwards s"), ("host_load_s", "host->device copies s"),
                       ("host_write_back_s", "device->host copies s")):
        cells = " | ".join(f"{row[key]:.2f}" if key != "prefill_tokens" else f"{row[key]:,}"
                           for row in (off, on, full))
        print(f"| {label} | {cells} |")
    print(f"\ntier on / off turn throughput: {on['turns_per_s'] / off['turns_per_s']:.2f}x; "
          f"hit rate vs unlimited: {on['hit_rate'] / full['hit_rate']:.3f}")
    print(f"TTFT of a {args.ttft_tokens}-token returning conversation: host {ttft['ttft_host_s'] * 1e3:.1f} ms, "
          f"recompute {ttft['ttft_recompute_s'] * 1e3:.1f} ms ({ttft['host_over_recompute']:.3f}x)")
    print(f"copy bandwidth reached h2d {reached['h2d']:.1f} GB/s, d2h {reached['d2h']:.1f} GB/s; "
          f"link peak h2d {peak['h2d']:.1f} GB/s, d2h {peak['d2h']:.1f} GB/s")
    if fetch is not None:
        print(f"TTFT of the same fetched from another replica (2 at 0.5 GPU, Ray): "
              f"{fetch['fetched_s'] * 1e3:.1f} ms, computed there {fetch['computed_s'] * 1e3:.1f} ms "
              f"({fetch['ratio']:.3f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "pool": pool, "host_gb": host_gb, "rows": rows,
                       "ttft": ttft, "reached_gb_s": reached, "peak_gb_s": peak,
                       "replica_fetch": fetch}, f, indent=1)


def replica_fetch(args) -> dict:
    """scripts/bench_prefix_fetch.py's result for a `ttft_tokens` history."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "bench_prefix_fetch.py"),
                        "--model", args.model, "--history", str(args.ttft_tokens),
                        "--reps", str(args.reps), "--json", out.name], check=True)
        with open(out.name) as f:
            return json.load(f)


def _free() -> None:
    """Give the last engine's memory back before the next one sizes its pool."""
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
