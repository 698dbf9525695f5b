"""Extend attention on a GPU: our Triton kernel against PyTorch's bundled FlashAttention-2
(varlen) fed by a gather of each request's K/V from the pool, and, when the `flashinfer`
package imports, against the engine's FlashInfer path (engine/attention/flashinfer_prefill.py:
FlashInfer's Hopper "fa3" paged prefill reading the pool in place, pages of one slot); per
case: time, TFLOP/s, relative difference, and which kernel the engine's rule picks.

    python3 scripts/bench_flash_extend.py [--no-flashinfer] [--cases=NAME,NAME]

FlashInfer is not on the GPU machine: `scripts/flashinfer_wheels.sh` fetches its wheels and
prints how to carry them (benchmarks/attention_notes.md says why only FlashInfer).

The question it answered (benchmarks/attention_notes.md, 2026-12-02, H200): should large
prefill steps leave the Triton kernel for `torch.ops.aten._flash_attention_forward`? No: the
Triton kernel was faster at every case, 1.1-1.5x at long prompts. Cases (requests x new
tokens on a cached prefix): long prompts' chunks, fresh prompt batches, short extends over
long contexts. The flash time includes the per-layer K/V gather; the per-step index build is
timed apart.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from check_attention import D, extend_batch, extend_flops, extend_reference  # noqa: E402
from engine.attention.base import ForwardBatch  # noqa: E402
from engine.attention.flashinfer_prefill import (FlashInferPrefill, host_indptr,  # noqa: E402
                                                 key_slots, worth_it)
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

# The candidate rule for sending a step to flash: enough new tokens, contexts not much longer.
MIN_NEW_TOKENS, MAX_KEYS_PER_NEW_TOKEN = 1024, 4


def flash_candidate(batch: ForwardBatch) -> bool:
    new = sum(batch.extend_lens_cpu)
    return new >= MIN_NEW_TOKENS and sum(batch.seq_lens_cpu) <= MAX_KEYS_PER_NEW_TOKEN * new


class FlashExtend:
    """One step's gather indices and lengths (built once), then one call per layer."""

    def __init__(self, batch: ForwardBatch) -> None:
        self.cu_k = host_indptr(batch.seq_lens_cpu).to(batch.seq_lens.device)
        self.slots = key_slots(batch.req_to_token, batch.req_rows, batch.seq_lens,
                               sum(batch.seq_lens_cpu)).long()
        self.cu_q = batch.qo_indptr
        self.max_q = max(batch.extend_lens_cpu)
        self.max_k = max(batch.seq_lens_cpu)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float, out: torch.Tensor) -> None:
        """q [T, Hq, D] of the step's new tokens (their K/V already in the pool) -> out."""
        k = k_cache.index_select(0, self.slots)
        v = v_cache.index_select(0, self.slots)
        attn = torch.ops.aten._flash_attention_forward(
            q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, 0.0, True, False,
            scale=scale)[0]
        out.copy_(attn)


def time_flashinfer(batch, q, pool, tri) -> tuple[float, float, float]:
    """The engine's FlashInfer path (engine/attention/flashinfer_prefill.py) on the whole
    step: (us per layer, us to plan a step, relative difference to the Triton output); NaNs
    when FlashInfer is missing or refuses the case (printed)."""
    try:
        fi = FlashInferPrefill(q.device, D ** -0.5, q.shape[1], pool.k[0].shape[1], D, q.dtype)
        fi.plan(batch, 0)
        out = torch.empty_like(q)
        fi.run(q, pool.k[0], pool.v[0], out)
        t_run = do_bench(lambda: fi.run(q, pool.k[0], pool.v[0], out), warmup=10, rep=50,
                         return_mode="median")
        t_plan = do_bench(lambda: fi.plan(batch, 0), warmup=2, rep=10, return_mode="median")
        diff = float((out.float() - tri.float()).norm() / tri.float().norm())
        return t_run * 1e3, t_plan * 1e3, diff
    except Exception as e:  # noqa: BLE001 - an optional comparison: report, go on
        print(f"  flashinfer: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan"), float("nan"), float("nan")


CASES = [("1x8192 p0", [(0, 8192)]), ("1x8192 p8192", [(8192, 8192)]),
         ("2x8192 p0", [(0, 8192)] * 2), ("8x2048 p0", [(0, 2048)] * 8),
         ("8x512 p0", [(0, 512)] * 8), ("4x1024 p1024", [(1024, 1024)] * 4),
         ("64x64 p1216", [(1216, 64)] * 64), ("1x16000 p0", [(0, 16000)]),
         # W1's mixed steps: ~8,192 new tokens of fresh 128-1,024-token prompts
         ("16x512 p0", [(0, 512)] * 16), ("14x576 p0", [(0, 576)] * 14),
         ("8x1024 p0", [(0, 1024)] * 8), ("32x256 p0", [(0, 256)] * 32)]


def main() -> None:
    args = sys.argv[1:]
    use_flashinfer = "--no-flashinfer" not in args
    only = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("--cases=")), None)
    rows, fi_rows = [], []
    for name, reqs in CASES:
        if only is not None and name not in only:
            continue
        pool, batch, q, k, v = extend_batch(reqs)
        be = TritonAttentionBackend(pool, D ** -0.5)
        be.prepare(batch)
        tri = torch.empty_like(q)
        be.forward(q, k, v, 0, batch, out=tri)  # also stores the new K/V in the pool
        t_tri = do_bench(lambda: be.extend(q, k, v, pool.k[0], pool.v[0], tri, batch),
                         warmup=10, rep=50, return_mode="median")
        prep = FlashExtend(batch)
        t_prep = do_bench(lambda: FlashExtend(batch), warmup=5, rep=20, return_mode="median")
        fl = torch.empty_like(q)
        prep(q, pool.k[0], pool.v[0], D ** -0.5, fl)
        t_fl = do_bench(lambda: prep(q, pool.k[0], pool.v[0], D ** -0.5, fl),
                        warmup=10, rep=50, return_mode="median")
        diff = float((fl.float() - tri.float()).norm() / tri.float().norm())
        ref_err = float("nan")
        if sum(p + e for p, e in reqs) * len(reqs) <= 20000:
            ref = extend_reference(pool, batch, q, k, v)
            ref_err = float((fl.float() - ref).norm() / ref.norm())
        flops = extend_flops(reqs)
        rows.append((name, t_tri * 1e3, t_fl * 1e3, t_prep * 1e3, flops / (t_tri * 1e9),
                     flops / (t_fl * 1e9), diff, ref_err, flash_candidate(batch)))
        print(rows[-1], flush=True)
        if use_flashinfer:
            fi_rows.append((name, t_tri * 1e3, flops, worth_it(batch.extend_lens_cpu))
                           + time_flashinfer(batch, q, pool, tri))
            print(fi_rows[-1], flush=True)
        del pool, batch, q, k, v, be, prep, tri, fl
        torch.cuda.empty_cache()
    print(f"\n{'case':<14} {'triton us':>10} {'flash us':>9} {'index us':>9} {'tri TF/s':>9} "
          f"{'fl TF/s':>8} {'speed-up':>8} {'rel diff':>9} {'vs ref':>8} rule")
    for name, tt, tf, tp, ft, ff, diff, ref_err, used in rows:
        print(f"{name:<14} {tt:>10.1f} {tf:>9.1f} {tp:>9.1f} {ft:>9.0f} {ff:>8.0f} {tt / tf:>8.2f} "
              f"{diff:>9.1e} {ref_err:>8.1e} {'yes' if used else 'no'}")
    if fi_rows:
        print(f"\n{'case':<14} {'triton us':>10} {'fa3 us':>8} {'plan us':>8} {'fa3 TF/s':>9} "
              f"{'speed-up':>8} {'rel diff':>9} engine's rule")
        for name, tt, flops, rule, t3, p3, d3 in fi_rows:
            print(f"{name:<14} {tt:>10.1f} {t3:>8.1f} {p3:>8.1f} {flops / (t3 * 1e6):>9.0f} "
                  f"{tt / t3:>8.2f} {d3:>9.1e} {'flashinfer' if rule else 'triton'}")


if __name__ == "__main__":
    main()
