"""Scheduler + radix cache + batch-building overhead per decode step, with the model's
forward replaced by a no-op that returns fixed logits.

    python scripts/bench_scheduler.py [--batch-sizes 1,64,256] [--steps 200] [--json PATH]
    python scripts/bench_scheduler.py --multi-turn 64,4,1024,128,64
    python scripts/bench_scheduler.py --w1 1000

`--multi-turn C,T,F,A,U`: the host side of W4 (scripts/bench_offline.py --w4): C conversations,
T turns, an F-token first message, A-token answers, a U-token new message per turn, each
turn's prompt the previous one + its answer + the new message (radix hits up to it). Per
turn: the prefill steps' time and the decode steps' mean and p99, against which a GPU's
decode step of the same shape can be set (is the host side what makes a turn slow?).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import random
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loading.demo_model import ensure_demo_model  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from engine.executor.prompt_logprobs import PromptScores  # noqa: E402


def null_forward(runner, vocab: int, max_batch: int):
    fixed = torch.randn(max_batch, vocab, generator=torch.Generator().manual_seed(0))

    def forward(plan, pending=None):
        runner.build_batch(plan)  # batch building is scheduler-side work: keep it timed
        return fixed[:len(plan.chunks)], PromptScores([], [])

    return forward


def measure(batch: int, steps: int, prompt_len: int, repetition_penalty: float = 1.0) -> dict:
    cfg = EngineConfig(model=ensure_demo_model(), dtype="float32", device="cpu",
                       max_total_tokens=batch * (prompt_len + steps + 8) + 64,
                       max_running_requests=max(batch, 1), chunked_prefill_size=batch * prompt_len,
                       max_model_len=prompt_len + steps + 16)
    eng = Engine(cfg)
    eng.runner.forward = null_forward(eng.runner, eng.runner.vocab_size, batch)
    for i in range(batch):
        prompt = [(7 * i + j) % 400 + 3 for j in range(prompt_len)]
        eng.add_request(f"b{i}", prompt, SamplingParams(max_tokens=steps + 4, temperature=0.0,
                                                        ignore_eos=True,
                                                        repetition_penalty=repetition_penalty))
    while eng.scheduler.waiting or any(r.pending_len > 1 for r in eng.scheduler.running):
        eng.step()  # admit and prefill everything first
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"batch": batch, "mean_ms": 1e3 * sum(times) / len(times),
            "p50_ms": 1e3 * times[len(times) // 2], "p99_ms": 1e3 * times[int(len(times) * 0.99)]}


def multi_turn(conversations: int, turns: int, first: int, answer: int, user: int) -> list[dict]:
    context = first + turns * (answer + user) + 64
    cfg = EngineConfig(model=ensure_demo_model(), dtype="float32", device="cpu",
                       max_total_tokens=2 * conversations * context,
                       max_running_requests=conversations, chunked_prefill_size=8192,
                       max_model_len=context)
    eng = Engine(cfg)
    eng.runner.forward = null_forward(eng.runner, eng.runner.vocab_size, 8192)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 700) for _ in range(first)] for _ in range(conversations)]
    params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    rows = []
    for turn in range(turns):
        before = eng.stats()
        reqs = [eng.add_request(f"t{turn}c{i}", p, params) for i, p in enumerate(prompts)]
        prefill, decode = [], []
        while eng.has_work:
            prefilling = bool(eng.scheduler.waiting) or any(r.pending_len > 1 for r in eng.scheduler.running)
            t0 = time.perf_counter()
            eng.step()
            (prefill if prefilling else decode).append(time.perf_counter() - t0)
        after = eng.stats()
        decode.sort()
        rows.append({"turn": turn + 1, "prompt_len": len(prompts[0]),
                     "hit_rate": (after["cached_tokens"] - before["cached_tokens"])
                     / (after["prompt_tokens"] - before["prompt_tokens"]),
                     "prefill_steps": len(prefill), "prefill_ms": 1e3 * sum(prefill),
                     "decode_steps": len(decode), "decode_mean_ms": 1e3 * sum(decode) / len(decode),
                     "decode_p99_ms": 1e3 * decode[int(0.99 * len(decode))]})
        prompts = [p + eng.output_of(r).token_ids + [rng.randrange(3, 700) for _ in range(user)]
                   for p, r in zip(prompts, reqs)]
    return rows


def w1_host(requests: int = 1000, running: int = 1024) -> dict:
    """The host side of W1 (scripts/bench_offline.py): `requests` prompts of 128-1,024 tokens
    with 32-512 outputs, all at once, 8,192-token chunks; per-step host time of the mixed
    steps (a prompt chunk in them) and the decode steps, to set against a GPU's step times."""
    rng = random.Random(0)
    reqs = [([rng.randrange(3, 700) for _ in range(rng.randint(128, 1024))], rng.randint(32, 512))
            for _ in range(requests)]
    cfg = EngineConfig(model=ensure_demo_model(), dtype="float32", device="cpu",
                       max_total_tokens=sum(len(p) + n for p, n in reqs) + 64,
                       max_running_requests=running, chunked_prefill_size=8192, max_model_len=1600)
    eng = Engine(cfg)
    eng.runner.forward = null_forward(eng.runner, eng.runner.vocab_size, 8192)
    for i, (prompt, n) in enumerate(reqs):
        eng.add_request(f"w{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    mixed, decode = [], []
    while eng.has_work:
        prefilling = bool(eng.scheduler.waiting) or any(r.pending_len > 1 for r in eng.scheduler.running)
        t0 = time.perf_counter()
        for update in eng.step():
            if update.finished:  # dropped, as LLM.generate and the server do
                eng.requests.pop(update.req.request_id, None)
        (mixed if prefilling else decode).append(time.perf_counter() - t0)
    return {kind: {"steps": len(t), "total_s": sum(t), "mean_ms": 1e3 * sum(t) / len(t),
                   "p50_ms": 1e3 * sorted(t)[len(t) // 2], "max_ms": 1e3 * max(t)}
            for kind, t in (("mixed", mixed), ("decode", decode)) if t}


def print_multi_turn(rows: list[dict]) -> None:
    print(f"{'turn':>4} {'prompt':>7} {'hit':>6} {'prefill steps':>14} {'prefill ms':>11} "
          f"{'decode steps':>13} {'decode ms/step':>15} {'p99':>7}")
    for r in rows:
        print(f"{r['turn']:>4} {r['prompt_len']:>7} {r['hit_rate']:>6.3f} {r['prefill_steps']:>14} "
              f"{r['prefill_ms']:>11.1f} {r['decode_steps']:>13} {r['decode_mean_ms']:>15.3f} "
              f"{r['decode_p99_ms']:>7.3f}")


def main() -> None:
    # The no-op forward leaves only tiny tensor ops, which a thread pool only slows down.
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every request's (e.g. 1.05, Qwen2.5's generation_config default)")
    ap.add_argument("--multi-turn", default=None, metavar="C,T,F,A,U",
                    help="instead: the host side of W4-shaped multi-turn traffic")
    ap.add_argument("--w1", default=None, metavar="REQUESTS", type=int,
                    help="instead: the host side of W1-shaped traffic (1000 for W1 itself)")
    args = ap.parse_args()
    if args.w1:
        res = w1_host(args.w1)
        for kind, r in res.items():
            print(f"{kind:>6}: {r['steps']} steps, {r['total_s']:.2f} s, mean {r['mean_ms']:.2f} ms, "
                  f"p50 {r['p50_ms']:.2f}, max {r['max_ms']:.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    if args.multi_turn:
        rows = multi_turn(*(int(x) for x in args.multi_turn.split(",")))
        print_multi_turn(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows = [measure(int(b), args.steps, args.prompt_len, args.repetition_penalty)
            for b in args.batch_sizes.split(",")]
    print(f"{'batch':>6} {'mean ms/step':>13} {'p50':>8} {'p99':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['mean_ms']:>13.3f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
