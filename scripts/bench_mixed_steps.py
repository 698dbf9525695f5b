"""Mixed steps on a GPU: a step holding both decoding requests and prefill chunks. The
engine attends for a mixed step's leading decoders with the decode kernel and runs the
extend kernel on the prefill chunks only; before 2026-12-02 the extend kernel took every
request, each decoder as a one-row query tile per query head. This runs W1 (where 71 of
~580 steps are mixed and take over half its GPU time) both ways, prints the GPU time per
phase, and with `--profile A:B` the kernel table of steps A..B-1 of the engine's way.

    python scripts/bench_mixed_steps.py [--model llama3-8b|moe] [--profile 20:22] [--engine KEY=VALUE]
    python scripts/bench_mixed_steps.py --graph-attention

`--graph-attention` times instead one layer's attention of mixed steps small enough for an
extend CUDA graph (<= 16 requests), captured as the extend graphs capture it: decoders found
on the device and sent to the decode kernel, against the extend kernel taking every request
(as those graphs did before), with the two outputs' relative difference.
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


GRAPH_CASES = [("15 decoders x 2,048 + 300 new", [(2047, 1)] * 15 + [(0, 300)]),
               ("15 decoders x 512 + 300 new", [(511, 1)] * 15 + [(0, 300)]),
               ("7 decoders x 4,096 + 64 new", [(4095, 1)] * 7 + [(0, 64)]),
               ("3 decoders x 1,024 + 500 new", [(1023, 1)] * 3 + [(0, 500)])]


def graph_attention_rows() -> None:
    import torch
    from check_attention import D, extend_batch, graph_time_us

    from engine.attention.triton_backend import TritonAttentionBackend

    print(f"\none layer's attention of a mixed step in an extend graph, us (32 q / 8 KV heads, {D} wide)")
    print(f"{'step':<32} {'extend only':>11} {'decoders found':>14} {'speed-up':>8} {'rel diff':>9}")
    for name, reqs in GRAPH_CASES:
        pool, batch, q, k, v = extend_batch(reqs)
        times, outs = [], []
        for on_device in (False, True):
            batch.decoders_on_device = on_device
            backend = TritonAttentionBackend(pool, D ** -0.5, graph_mode=True)
            backend.prepare(batch)
            out = torch.empty_like(q)
            times.append(graph_time_us(lambda: backend.forward(q, k, v, 0, batch, out=out), 4))
            outs.append(out.float())
        rel = float((outs[1] - outs[0]).norm() / outs[0].norm())
        print(f"{name:<32} {times[0]:>11.1f} {times[1]:>14.1f} {times[0] / times[1]:>7.2f}x "
              f"{rel:>9.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(bo.MODELS))
    ap.add_argument("--profile", default=None, metavar="A:B")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None)
    ap.add_argument("--graph-attention", action="store_true")
    args = ap.parse_args()
    if args.graph_attention:
        graph_attention_rows()
        return
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
