"""Speculative decoding (n-gram drafts) on copy-heavy prompts, offline: target forwards per
output token and acceptance, against plain decoding, for several draft lengths.

    python scripts/bench_speculative.py [--model PATH] [--draft-tokens 1,2,4,8]
        [--batch 1] [--max-tokens 128] [--json PATH]

Without --model it uses a tiny random demo model with small weights (init_std=0.02),
whose greedy output soon repeats itself: a stand-in copy workload, not a real model's
acceptance. With a real model (e.g. one that `LLM(model=...)` loads) the prompts ask it
to repeat and edit text and code, where prompt lookup pays off.

Counts (forwards, tokens, acceptance) are device-independent; wall time per output token
is printed too, and only means something on an otherwise idle machine (on a GPU it is the
real cost side: a verify forward of k + 1 tokens against a plain decode step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from engine import LLM, SamplingParams  # noqa: E402
from engine.demo_model import build_tiny_model  # noqa: E402

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''
TEXT = ("The old lighthouse stood at the edge of the harbour, and every evening the keeper "
        "climbed the spiral stairs to light the lamp.")
TEXT_PROMPTS = [
    f"Repeat this text exactly:\n{TEXT}\nRepeated:\n",
    f"Rename the function `mean` to `average` in this code:\n{CODE}\nResult:\n",
    f"Fix the spelling in this text:\n{TEXT.replace('harbour', 'harbor')}\nFixed:\n",
    f"Add a docstring to this code:\n{CODE}\nResult:\n",
]


def demo_prompts(n: int) -> list[list[int]]:
    import random

    r = random.Random(0)
    out = []
    for _ in range(n):
        base = [r.randint(3, 700) for _ in range(r.randint(10, 40))]
        out.append(base + base[:5])
    return out


def run(model: str, prompts, draft_tokens: int | None, max_tokens: int, kw: dict) -> dict:
    spec = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=draft_tokens) \
        if draft_tokens else {}
    llm = LLM(model=model, **kw, **spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    s = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    steps = s["steps"] - before["steps"]
    return {"draft_tokens": draft_tokens or 0, "output_tokens": tokens, "steps": steps,
            "forwards_per_token": steps * 1.0 / (tokens / len(prompts)),
            "acceptance_rate": s.get("spec_acceptance_rate", 0.0),
            "mean_acceptance_length": s.get("spec_mean_acceptance_length", 1.0),
            "ms_per_token": 1e3 * wall / (tokens / len(prompts)), "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--draft-tokens", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    model = args.model
    if model:
        prompts = (TEXT_PROMPTS * args.batch)[:max(args.batch, 1)]
    else:
        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "radixserve-bench-spec"),
                                 "llama", init_std=0.02)
        prompts = demo_prompts(args.batch)
    kw = dict(device=args.device, max_total_tokens=16384, max_running_requests=max(args.batch, 1))
    if args.device in ("cpu", "auto") and not args.model:
        kw["dtype"] = "float32"
    rows = [run(model, prompts, None, args.max_tokens, kw)]
    rows += [run(model, prompts, int(k), args.max_tokens, kw) for k in args.draft_tokens.split(",")]
    plain = rows[0]
    print(f"model={args.model or 'demo (random, init_std=0.02)'} batch={args.batch} "
          f"max_tokens={args.max_tokens}")
    print(f"{'k':>3} {'fwd/token':>10} {'fewer fwd':>10} {'accept':>7} {'accept len':>11} "
          f"{'ms/token':>9} {'same output':>12}")
    for r in rows:
        print(f"{r['draft_tokens']:>3} {r['forwards_per_token']:>10.3f} "
              f"{plain['forwards_per_token'] / r['forwards_per_token']:>9.2f}x "
              f"{r['acceptance_rate']:>7.2f} {r['mean_acceptance_length']:>11.2f} "
              f"{r['ms_per_token']:>9.2f} {str(r['outputs'] == plain['outputs']):>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
