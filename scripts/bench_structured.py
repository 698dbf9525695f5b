"""Structured output on CPU with the tiny demo model: per-token decode cost of constrained
decoding (a JSON schema, a regex) against unconstrained decoding, and what jump-forward
saves on a JSON workload.

    python scripts/bench_structured.py [--tokens 64] [--repeats 9] [--batch-sizes 1,64]
                                       [--threads 1] [--json PATH]

Overhead: every request of a batch generates exactly `--tokens` tokens. Unconstrained
requests use ignore_eos; the constraints cannot end earlier (an array with minItems and a
regex with a `{N,}` repeat), so all requests finish with "length" (checked). Jump-forward is
off here, so every output token is sampled through the mask. Only full decode steps are
timed (scheduling, forward, mask fill and upload, sampling, matcher advance). Each run
(one batch, one mode) gives its median step time, in wall-clock and in process CPU time;
modes run interleaved in a rotating order. Reported: the best run's wall time (the least
disturbed by other jobs on a shared machine) and the median CPU time over runs; the CPU
overhead is the median of the per-repeat ratios against the unconstrained run next to it.
torch runs on one thread by default (`--threads`): then CPU time ~ wall time when the
machine is quiet, and both stay steady when it is not.

Jump-forward: the schemas of tests/test_structured.py, three prompts x three samplers,
batched, jump-forward on vs off, from the engine's counters (`steps`,
`Engine.num_jump_forward_tokens`) plus the tokens each step's forward pass processed
(prompts are cached by a warm-up, so those are output tokens whose KV was computed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.loading.demo_model import ensure_demo_model  # noqa: E402

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"}}, "required": ["name", "age", "member"]}


def modes(tokens: int) -> dict[str, dict]:
    """SamplingParams fields per mode; no constraint can finish within `tokens` tokens."""
    return {
        "unconstrained": dict(ignore_eos=True),
        "json_schema": dict(json_schema={"type": "array", "items": ITEM, "minItems": tokens}),
        "regex": dict(regex=r"(\d{3}-\d{4}; ){%d,}" % tokens),
    }


class StepTimer:
    """Wraps an engine's step: the duration of every step, its plan, and the time spent
    building grammar masks, plus the total tokens its forward passes processed."""

    def __init__(self, llm: LLM) -> None:
        self.engine = engine = llm.engine
        # (wall seconds, process CPU seconds, pure decode?, sampled rows)
        self.steps: list[tuple[float, float, bool, int]] = []
        self.mask_s: list[float] = []
        self.forward_tokens = 0
        self._plan = None
        self._rows = 0
        self._mask = 0.0
        forward, masks, step = engine.runner.forward, engine.grammars.token_masks, engine.step

        def timed_forward(plan):
            self._plan, self._rows = plan, sum(c.samples for c in plan.chunks)  # before appending
            self.forward_tokens += plan.num_tokens
            return forward(plan)

        def timed_masks(reqs):
            t = time.perf_counter()
            try:
                return masks(reqs)
            finally:
                self._mask += time.perf_counter() - t

        def timed_step():
            self._plan, self._mask = None, 0.0
            t, c = time.perf_counter(), time.process_time()
            out = step()
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if self._plan is not None:
                plan = self._plan
                self.steps.append((dt, dc, plan.is_decode, self._rows))
                if plan.is_decode:
                    self.mask_s.append(self._mask)
            return out

        engine.runner.forward = timed_forward
        engine.grammars.token_masks = timed_masks
        engine.step = timed_step

    def reset(self) -> None:
        self.steps.clear()
        self.mask_s.clear()
        self.forward_tokens = 0


def run_batch(llm: LLM, timer: StepTimer, fields: dict, batch: int, tokens: int, tag: str) -> dict:
    prompts = [f"{p} ({tag} {i})" for i, p in
               zip(range(batch), ["The old lighthouse", "Numbers are everywhere",
                                  "She opened the letter", "In the market square"] * batch)]
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, **fields) for i in range(batch)]
    timer.reset()
    outs = llm.generate(prompts, params)
    bad = [o for o in outs if o.finish_reason != "length" or len(o.token_ids) != tokens]
    if bad:
        raise SystemExit(f"{tag}: {len(bad)} requests did not generate exactly {tokens} tokens: "
                         f"{bad[0].finish_reason} after {len(bad[0].token_ids)}")
    # Full decode steps only (every request in the batch, no prefill chunk).
    decode = [(dt, dc) for dt, dc, is_decode, rows in timer.steps if is_decode and rows == batch]
    if not decode:
        raise SystemExit(f"{tag}: no full decode step was timed")
    return {"step_ms": 1e3 * statistics.median(dt for dt, _ in decode),
            "cpu_ms": 1e3 * statistics.median(dc for _, dc in decode),
            "mask_ms": 1e3 * statistics.median(timer.mask_s) if timer.mask_s else 0.0,
            "decode_steps": len(decode)}


def bench_overhead(model: str, batch_sizes: list[int], tokens: int, repeats: int) -> list[dict]:
    llm = LLM(model=model, dtype="float32", max_total_tokens=max(8192, 2 * max(batch_sizes) * (tokens + 32)),
              max_running_requests=max(batch_sizes), enable_jump_forward=False)
    timer = StepTimer(llm)
    spec = modes(tokens)
    names = list(spec)
    rows = []
    for batch in batch_sizes:
        for name in names:  # warm-up: compiles, first matchers, allocator
            run_batch(llm, timer, spec[name], batch, min(tokens, 16) if name == "unconstrained" else tokens,
                      f"warm {name}")
        results: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                results[name].append(run_batch(llm, timer, spec[name], batch, tokens, f"r{r} {name}"))
        base = results["unconstrained"]
        best_base = min(x["step_ms"] for x in base)
        for name in names:
            res = results[name]
            cpu_ratios = [a["cpu_ms"] / b["cpu_ms"] for a, b in zip(res, base)]
            best = min(x["step_ms"] for x in res)  # the least disturbed run
            cpu = statistics.median(x["cpu_ms"] for x in res)
            rows.append({
                "mode": name, "batch": batch, "tokens_per_request": tokens, "repeats": repeats,
                "wall_step_ms": best, "wall_ms_per_token": best / batch,
                "wall_step_ms_median": statistics.median(x["step_ms"] for x in res),
                "cpu_step_ms": cpu, "cpu_ms_per_token": cpu / batch,
                "mask_ms_per_step": statistics.median(x["mask_ms"] for x in res),
                "overhead_wall": best / best_base - 1.0,
                "overhead_cpu": statistics.median(cpu_ratios) - 1.0,
                "overhead_cpu_min": min(cpu_ratios) - 1.0, "overhead_cpu_max": max(cpu_ratios) - 1.0,
            })
            r = rows[-1]
            print(f"  batch {batch:>3} {name:<13} wall {r['wall_ms_per_token']:7.3f} ms/token "
                  f"({100 * r['overhead_wall']:+6.1f}%)  cpu {r['cpu_ms_per_token']:7.3f} ms/token "
                  f"({100 * r['overhead_cpu']:+6.1f}%)  mask {r['mask_ms_per_step']:.3f} ms/step", flush=True)
    return rows


def bench_jump_forward(model: str) -> list[dict]:
    from test_structured import PROMPTS, SAMPLERS, SCHEMAS, check_json

    cases = [(s, p, kw) for s in SCHEMAS for p, kw in zip(PROMPTS, SAMPLERS)]
    rows = []
    for jump in (False, True):
        llm = LLM(model=model, dtype="float32", max_total_tokens=16384, max_running_requests=64,
                  enable_jump_forward=jump)
        timer = StepTimer(llm)
        llm.generate(PROMPTS, SamplingParams(max_tokens=4))  # warm-up, not counted
        steps0, gen0 = llm.stats()["steps"], llm.stats()["generated_tokens"]
        timer.reset()
        t = time.perf_counter()
        params = [SamplingParams(max_tokens=200, json_schema=s, **kw) for s, _, kw in cases]
        outs = llm.generate([p for _, p, _ in cases], params)
        wall = time.perf_counter() - t
        stats = llm.stats()
        output_tokens = sum(len(o.token_ids) for o in outs)
        assert output_tokens == stats["generated_tokens"] - gen0
        stopped = check_json(llm, outs, params, [s for s, _, _ in cases])  # raises on an invalid output
        jumped = llm.engine.num_jump_forward_tokens
        rows.append({
            "jump_forward": jump, "requests": len(cases), "stopped": stopped,
            "output_tokens": output_tokens, "jump_forward_tokens": jumped,
            "sampled_tokens": output_tokens - jumped,
            "steps": stats["steps"] - steps0, "forward_tokens": timer.forward_tokens,
            "wall_s": wall,
        })
        print(f"  jump-forward {'on ' if jump else 'off'}: {rows[-1]}", flush=True)
    return rows


def table(overhead: list[dict], jump: list[dict]) -> str:
    lines = ["| mode | batch | ms / output token, wall (best run) | overhead, wall | "
             "CPU ms / output token (median) | overhead, CPU (median of runs, min..max) | mask fill ms / step |",
             "|---|---|---|---|---|---|---|"]
    for r in overhead:
        base = r["mode"] == "unconstrained"
        wall = "—" if base else f"{100 * r['overhead_wall']:+.1f}%"
        cpu = "—" if base else (f"{100 * r['overhead_cpu']:+.1f}% "
                                f"({100 * r['overhead_cpu_min']:+.0f}..{100 * r['overhead_cpu_max']:+.0f}%)")
        lines.append(f"| {r['mode']} | {r['batch']} | {r['wall_ms_per_token']:.3f} | {wall} | "
                     f"{r['cpu_ms_per_token']:.3f} | {cpu} | {r['mask_ms_per_step']:.3f} |")
    lines += ["", "| jump-forward | requests (stopped) | output tokens | jumped | sampled | "
              "decode steps | forward tokens | wall (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in jump:
        lines.append(f"| {'on' if r['jump_forward'] else 'off'} | {r['requests']} ({r['stopped']}) | "
                     f"{r['output_tokens']} | {r['jump_forward_tokens']} | {r['sampled_tokens']} | "
                     f"{r['steps']} | {r['forward_tokens']} | {r['wall_s']:.2f} |")
    if len(jump) == 2:
        off, on = jump
        lines.append("")
        lines.append(f"Jump-forward: {on['jump_forward_tokens']} of {on['output_tokens']} output tokens "
                     f"({100 * on['jump_forward_tokens'] / on['output_tokens']:.0f}%) appended without "
                     f"sampling; decode steps {off['steps']} -> {on['steps']} "
                     f"({100 * (1 - on['steps'] / off['steps']):.0f}% fewer).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a small shared CPU more threads "
                         "spin and make CPU times noisy; 0 keeps torch's default)")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--no-jump-forward", action="store_true", help="skip the jump-forward part")
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = ensure_demo_model()
    print(f"model {model}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}", flush=True)
    print("overhead (jump-forward off):", flush=True)
    overhead = bench_overhead(model, batch_sizes, args.tokens, args.repeats)
    jump = [] if args.no_jump_forward else (print("jump-forward:", flush=True), bench_jump_forward(model))[1]
    print()
    print(table(overhead, jump))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overhead": overhead, "jump_forward": jump, "tokens": args.tokens,
                       "repeats": args.repeats, "machine": platform.platform(),
                       "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}, f, indent=2)


if __name__ == "__main__":
    main()
