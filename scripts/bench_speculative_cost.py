"""The cost side of speculative decoding on the GPU: what a step with k draft tokens per
request costs against a plain decode step, at several batch sizes, on dummy weights.

    python scripts/bench_speculative_cost.py [--model llama3-8b] [--k 1,2,4,8]
        [--batch 1,8,32] [--draft llama3.2-1b|same|none] [--steps 30] [--json PATH]

Random weights agree with no draft, so acceptance is not measured here (see
bench_speculative.py for a real model's); every draft is forced instead: an n-gram engine
whose proposer always offers k tokens (`FixedDrafts`, a benchmark harness), and with
--draft a draft-model engine (a Llama-3.2-1B-shaped dummy) that drafts k tokens per step.
Per (batch, k) it reports the step's wall time, the target's forward (CUDA events: the
verify forward of k + 1 tokens per request) and the draft's time, against the plain
engine's decode step (overlap on, as a user gets it, and off; speculation runs without
overlap). The projected speed-up at a mean acceptance length a (tokens kept per step, the
target's own token included) is a x plain step / speculative step: labelled projected.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_offline import (GPU, MODELS, StepPhases, make_engine, model_dir,  # noqa: E402
                           release_memory, sync)
from engine import SamplingParams  # noqa: E402
from engine.speculative.proposer import Proposer  # noqa: E402

PROMPT_LEN = 128
ACCEPT_LENGTHS = (2.0, 3.0)


class FixedDrafts(Proposer):
    """Always `k` random tokens (a benchmark harness: every step verifies k drafts)."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k, self.vocab, self.rng = k, vocab, random.Random(0)

    def propose(self, req, max_len: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(min(self.k, max_len))]


def start_batch(engine, batch: int, tag: str) -> list[str]:
    """`batch` requests decoding (prefill done), each with room for many more tokens."""
    rng = random.Random(batch)
    vocab = engine.runner.vocab_size
    room = min(4000, engine.max_context - PROMPT_LEN)
    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(PROMPT_LEN)], params)
    while any(engine.requests[rid].num_output == 0 for rid in ids):
        engine.step()
    return ids


def time_steps(engine, steps: int) -> dict:
    """Mean wall ms per engine step, the target's forward ms (CUDA events), draft ms."""
    for _ in range(3):
        engine.step()
    sync()
    phases = StepPhases(engine)
    draft_s = engine.stats().get("spec_draft_seconds", 0.0)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall = time.perf_counter() - t0
    summary = phases.summary(wall)
    phases.close()
    gpu = summary["decode"]["gpu_s"] + summary["prefill_or_mixed"]["gpu_s"]
    return {"step_ms": 1e3 * wall / steps, "target_forward_ms": 1e3 * gpu / steps,
            "draft_ms": 1e3 * (engine.stats().get("spec_draft_seconds", 0.0) - draft_s) / steps}


def finish(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_work:
        engine.step()


def plain_rows(path: str, batches: list[int], steps: int) -> dict:
    out = {}
    for overlap in (True, False):
        engine = make_engine(path, max_running_requests=64, cuda_graph_max_bs=64,
                             enable_overlap_schedule=overlap)
        for b in batches:
            ids = start_batch(engine, b, f"plain{b}")
            out[(b, overlap)] = time_steps(engine, steps)
            finish(engine, ids)
        del engine
        release_memory()
    return out


def spec_rows(path: str, batches: list[int], ks: list[int], steps: int, draft: str | None) -> dict:
    kmax = max(ks)
    spec = (dict(speculative_algorithm="draft_model", speculative_draft_model=draft,
                 speculative_num_steps=kmax, speculative_num_draft_tokens=kmax) if draft
            else dict(speculative_algorithm="ngram", speculative_num_draft_tokens=kmax))
    engine = make_engine(path, max_running_requests=64, cuda_graph_max_bs=64, **spec)
    if not draft:
        engine.speculator.proposer = FixedDrafts(kmax, engine.runner.vocab_size)
    out = {}
    for b in batches:
        ids = start_batch(engine, b, f"spec{b}")
        for k in ks:
            engine.speculator.max_draft = k
            if not draft:
                engine.speculator.proposer.k = k
            drafted = engine.stats().get("spec_drafted_tokens", 0)
            row = time_steps(engine, steps)
            row["drafted_per_request_step"] = (engine.stats().get("spec_drafted_tokens", 0)
                                               - drafted) / ((steps + 3) * b)
            out[(b, k)] = row
        finish(engine, ids)
    del engine
    release_memory()
    return out


def print_table(plain: dict, spec: dict[str, dict]) -> list[dict]:
    rows = []
    head = (f"{'source':<8} {'batch':>5} {'k':>2} {'drafted':>7} {'step ms':>8} {'verify fwd':>10} "
            f"{'draft ms':>8} {'plain step':>10} {'x plain':>7} {'x sync':>7}"
            + "".join(f" {'a=' + str(a) + ' proj':>10}" for a in ACCEPT_LENGTHS))
    print(head + "\n" + "-" * len(head))
    for source, table in spec.items():
        for (b, k), r in sorted(table.items()):
            base, sync_base = plain[(b, True)]["step_ms"], plain[(b, False)]["step_ms"]
            ratio = r["step_ms"] / base
            proj = [a * base / r["step_ms"] if a <= k + 1 else float("nan") for a in ACCEPT_LENGTHS]
            rows.append({"source": source, "batch": b, "k": k, **r, "plain_step_ms": base,
                         "plain_sync_step_ms": sync_base, "step_over_plain": ratio,
                         "projected_speedup": dict(zip(map(str, ACCEPT_LENGTHS), proj))})
            print(f"{source:<8} {b:>5} {k:>2} {r['drafted_per_request_step']:>7.2f} "
                  f"{r['step_ms']:>8.2f} {r['target_forward_ms']:>10.2f} {r['draft_ms']:>8.2f} "
                  f"{base:>10.2f} {ratio:>7.2f} {r['step_ms'] / sync_base:>7.2f}"
                  + "".join(f" {p:>10.2f}" for p in proj))
    for b in sorted({b for b, _ in plain}):
        print(f"plain decode, batch {b}: step {plain[(b, True)]['step_ms']:.2f} ms (overlap), "
              f"{plain[(b, False)]['step_ms']:.2f} ms (sync), forward "
              f"{plain[(b, False)]['target_forward_ms']:.2f} ms")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS) + ["demo"])
    ap.add_argument("--k", default="1,2,4,8")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--draft", default="llama3.2-1b", choices=["llama3.2-1b", "same", "none"],
                    help="the draft model: a 1B-shaped dummy, the target itself, or none")
    ap.add_argument("--draft-k", default="1,2,4", help="draft-model steps (k) to time")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not GPU:
        print("note: no GPU; the figures below are CPU timings (a smoke run)", flush=True)
    path = model_dir(args.model)
    batches = [int(x) for x in args.batch.split(",")]
    plain = plain_rows(path, batches, args.steps)
    spec = {"forced": spec_rows(path, batches, [int(x) for x in args.k.split(",")], args.steps, None)}
    if args.draft != "none":
        draft = path if args.draft == "same" else model_dir("llama3.2-1b")
        spec["draft"] = spec_rows(path, batches, [int(x) for x in args.draft_k.split(",")],
                                  args.steps, draft)
    rows = print_table(plain, spec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
