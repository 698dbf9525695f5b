"""Scheduler + radix cache + batch-building overhead per decode step, with the model's
forward replaced by a no-op that returns fixed logits.

    python scripts/bench_scheduler.py [--batch-sizes 1,64,256] [--steps 200] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.engine import Engine  # noqa: E402


def null_forward(runner, vocab: int, max_batch: int):
    fixed = torch.randn(max_batch, vocab, generator=torch.Generator().manual_seed(0))

    def forward(plan):
        runner.build_batch(plan)  # batch building is scheduler-side work: keep it timed
        return fixed[:len(plan.chunks)], []

    return forward


def measure(batch: int, steps: int, prompt_len: int) -> dict:
    cfg = EngineConfig(model=ensure_demo_model(), dtype="float32", device="cpu",
                       max_total_tokens=batch * (prompt_len + steps + 8) + 64,
                       max_running_requests=max(batch, 1), chunked_prefill_size=batch * prompt_len,
                       max_model_len=prompt_len + steps + 16)
    eng = Engine(cfg)
    eng.runner.forward = null_forward(eng.runner, eng.runner.vocab_size, batch)
    for i in range(batch):
        prompt = [(7 * i + j) % 400 + 3 for j in range(prompt_len)]
        eng.add_request(f"b{i}", prompt, SamplingParams(max_tokens=steps + 4, temperature=0.0,
                                                        ignore_eos=True))
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


def main() -> None:
    # The no-op forward leaves only tiny tensor ops, which a thread pool only slows down.
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [measure(int(b), args.steps, args.prompt_len) for b in args.batch_sizes.split(",")]
    print(f"{'batch':>6} {'mean ms/step':>13} {'p50':>8} {'p99':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['mean_ms']:>13.3f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
