"""W1's steps from the real scheduler, priced by a cost model of the H200 (CPU; not a measurement).

The engine's scheduler runs W1 (1,000 requests, 128-1,024 prompt tokens, 32-512 outputs, all
at once) with the model's forward replaced by fixed logits, and records each step's shape:
prompt tokens, decoding requests, and the K/V tokens those requests read. Each step is then
priced as GEMMs (every token's 2 x 7.0e9 FLOP at a rate by row count; at least the weights'
3.8 ms read) + decode attention (K/V bytes at 4.0 TB/s) + other (2 ms a step + 3 us a prompt
token). The rates come from H200 runs (benchmarks/RESULTS.md: cuBLAS 719-763 TFLOP/s at
2,048-8,192 rows in session 24; ~650 assumed at W1's ~480-row decode steps), and the model
lands within 3% of the measured run: 9,640 modelled against 9,894 measured tok/s (session 24,
8,192-token chunks).

It answers what W1's goal (11,000 tok/s) needs: how the time splits, what other chunk sizes
would give, what every GEMM at the machine's peak would, and what running the decode
attention beside the GEMMs would (the longer of the two instead of their sum;
scripts/bench_overlap.py measures whether the GPU can).

    python scripts/w1_step_model.py [--chunks 8192,4096,2048]
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_scheduler import null_forward  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.engine import Engine  # noqa: E402

FLOP_PER_TOKEN = 2 * 7.0e9  # Llama-3-8B's linears
WEIGHTS_S = 3.8e-3  # reading 16 GB of weights: a step's floor
KV_BYTES_PER_TOKEN = 131072  # 32 layers x 8 KV heads x 128 x (K, V) x bf16
KV_READ_RATE = 4.0e12
STEP_S, PROMPT_TOKEN_S = 2.0e-3, 3.0e-6  # norms, SiLU, RoPE, sampling, launches


def w1_steps(chunk: int) -> tuple[list[tuple[int, int, int]], int]:
    """Each step's (prompt tokens, decoding requests, K/V tokens they read); output tokens."""
    rng = random.Random(0)  # BENCHMARKS.md's W1 (token ids folded into the demo vocabulary)
    reqs = [([rng.randint(100, 120000) % 700 + 3 for _ in range(rng.randint(128, 1024))],
             rng.randint(32, 512)) for _ in range(1000)]
    config = EngineConfig(model=ensure_demo_model(), dtype="float32", device="cpu",
                          max_total_tokens=sum(len(p) + n for p, n in reqs) + 64,
                          max_running_requests=1024, chunked_prefill_size=chunk,
                          max_prefill_tokens=2 * chunk, max_model_len=1600)
    engine = Engine(config)
    forward = null_forward(engine.runner, engine.runner.vocab_size, 4 * chunk)
    steps = []

    def record(plan, pending=None):
        decoders = [c for c in plan.chunks if c.num_tokens == 1]
        steps.append((sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1), len(decoders),
                       sum(c.start + 1 for c in decoders)))
        return forward(plan, pending)

    engine.runner.forward = record
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_work:
        for update in engine.step():
            if update.finished:
                engine.requests.pop(update.req.request_id, None)
    return steps, sum(n for _, n in reqs)


def gemm_rate(rows: int) -> float:
    """bf16 TFLOP/s by rows (H200): ~650 at W1's decode batches, 763 at 2,048, 719 at 8,192."""
    if rows <= 479:
        return 650.0 * rows / 479
    if rows <= 2048:
        return 650 + (763 - 650) * (rows - 479) / (2048 - 479)
    return max(719.0, 763 - (763 - 719) * (rows - 2048) / 6144)


PEAK_TFLOPS = 790.0  # the machine's 8,192-cube bf16 product (session 24)


def price(step: tuple[int, int, int], rate=gemm_rate) -> tuple[float, float, float]:
    """(GEMM, decode attention, other) seconds of one step, GEMMs at `rate(rows)` TFLOP/s."""
    prompt, decoders, kv_tokens = step
    rows = prompt + decoders
    gemm = max(WEIGHTS_S, rows * FLOP_PER_TOKEN / (rate(rows) * 1e12))
    return gemm, kv_tokens * KV_BYTES_PER_TOKEN / KV_READ_RATE, STEP_S + prompt * PROMPT_TOKEN_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="8192,4096,2048", help="chunked_prefill_size values")
    args = ap.parse_args()
    print(f"{'chunk':>6} {'steps':>6} {'mixed':>6} {'GEMM s':>7} {'attn s':>7} {'other s':>8} "
          f"{'W1 s':>6} {'tok/s':>7} {'GEMMs at peak s':>16} {'tok/s':>7} "
          f"{'overlapped s':>13} {'tok/s':>7}")
    for chunk in (int(c) for c in args.chunks.split(",")):
        steps, outputs = w1_steps(chunk)
        parts = [price(s) for s in steps]
        gemm, attn, other = (sum(p[i] for p in parts) for i in range(3))
        total = gemm + attn + other
        at_peak = sum(sum(price(s, lambda rows: PEAK_TFLOPS)) for s in steps)
        overlapped = sum(max(g, a) + o for g, a, o in parts)
        mixed = sum(1 for s in steps if s[0])
        print(f"{chunk:>6} {len(steps):>6} {mixed:>6} {gemm:7.2f} {attn:7.2f} {other:8.2f} "
              f"{total:6.2f} {outputs / total:7,.0f} {at_peak:16.2f} {outputs / at_peak:7,.0f} "
              f"{overlapped:13.2f} {outputs / overlapped:7,.0f}", flush=True)


if __name__ == "__main__":
    main()
