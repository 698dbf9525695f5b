"""Mixed steps on a GPU: a step holding both decoding requests and prefill chunks. The
engine attends for a mixed step's leading decoders with the decode kernel and runs the
extend kernel on the prefill chunks only; before 2026-12-02 the extend kernel took every
request, each decoder as a one-row query tile per query head. This runs W1 (where 71 of
~580 steps are mixed and take over half its GPU time) both ways, prints the GPU time per
phase, and with `--profile A:B` the kernel table of steps A..B-1 of the engine's way.

    python scripts/bench_mixed_steps.py [--model llama3-8b|moe] [--profile 20:22] [--engine KEY=VALUE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_offline as bo  # noqa: E402
import engine.model_runner as model_runner  # noqa: E402

SPLIT = model_runner.leading_decode_rows


def run_w1(path: str, split: bool, profile: tuple[int, int] | None) -> dict:
    model_runner.leading_decode_rows = SPLIT if split else (lambda extend_lens: 0)
    try:
        engine = bo.make_engine(path)
        start = engine.runner.startup.summary()
        bo.run_requests(engine, bo.w1()[:64], "warm")
        engine.cache.reset()
        res = bo.run_requests(engine, bo.w1(), "w1", phases=True, profile_steps=profile)
    finally:
        model_runner.leading_decode_rows = SPLIT
    del engine
    bo.release_memory()
    ph = res["phases"]
    return {"split": split, "tok_s": res["output_tokens"] / res["wall_s"], "wall_s": res["wall_s"],
            "mixed_steps": ph["prefill_or_mixed"]["steps"],
            "mixed_gpu_s": ph["prefill_or_mixed"]["gpu_s"],
            "mixed_mean_ms": ph["prefill_or_mixed"]["mean_ms"],
            "mixed_mean_batch": ph["prefill_or_mixed"]["mean_batch"],
            "decode_steps": ph["decode"]["steps"], "decode_gpu_s": ph["decode"]["gpu_s"],
            "other_s": ph["other_s"], "engine_start": start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(bo.MODELS))
    ap.add_argument("--profile", default=None, metavar="A:B")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bo.ENGINE_OVERRIDES.update(bo.parse_overrides(args.engine))
    profile = tuple(int(x) for x in args.profile.split(":")) if args.profile else None
    path = bo.model_dir(args.model)
    rows = [run_w1(path, True, profile), run_w1(path, False, None)]
    print(f"\nW1, {args.model}: a mixed step's decoders by the decode kernel (engine) vs the extend kernel")
    print(f"{'decoders by':<12} {'tok/s':>8} {'wall s':>7} {'mixed steps':>11} {'mixed GPU s':>11} "
          f"{'ms/step':>8} {'batch':>6} {'decode GPU s':>12} {'other s':>7}")
    for r in rows:
        print(f"{'decode' if r['split'] else 'extend':<12} {r['tok_s']:>8.0f} {r['wall_s']:>7.2f} "
              f"{r['mixed_steps']:>11} {r['mixed_gpu_s']:>11.2f} {r['mixed_mean_ms']:>8.1f} "
              f"{r['mixed_mean_batch']:>6.0f} {r['decode_gpu_s']:>12.2f} {r['other_s']:>7.2f}")
    for r in rows:
        print(f"engine start ({'decode' if r['split'] else 'extend'}): {r['engine_start']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
