"""Does a decode GEMV run faster when its weights were asked into L2 while the bus idled?
(engine/layers/l2_prefetch.py; H100/H200 only.)

Each timed chain emulates the stretch of a batch-1 layer before a GEMV: a copy of 2 x 256 MB
(the MLP's reads: it also pushes the weight out of L2), optionally `prefetch_l2` of the GEMV's
weight, a kernel that only waits `idle` microseconds (RoPE, attention and its reduce, which
read almost nothing), then the engine's GEMV at one row. Chains run under PDL as in the
engine, ten to a CUDA graph. Per (weight, idle, prefetched bytes) the table gives the chain's
time and the GEMV's part of it (the chain minus the same chain without the GEMV), against the
weight's floor at the measured copy rate, and what the chain saved against the same chain
without a prefetch ("cold"): the figure that decides, since a prefetch that did not finish
in the idle stretch still moves its bytes, later. "warm" rows skip the copy (the upper
bound: the whole weight left in L2 by the chain before, where it fits); "f" rows issue the
prefetch from the waiting kernel itself (a prefetch fused into RoPE or attention) instead of
a launch of its own.

    python3 scripts/bench_l2_prefetch.py [--idle 0,4,8] [--prefetch-mb 0,8,16,32,all]
                                         [--chunks-kb 16] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.layers import l2_prefetch  # noqa: E402
from engine.kernels.gemv import gemv  # noqa: E402
from engine.kernels.pdl import pdl_launch, pdl_prologue  # noqa: E402
from bench_layer_kernels import graph_us  # noqa: E402

# Llama-3-8B's linears that sit after a stretch of small kernels (N, K)
SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336)}
FLUSH_BYTES = 256 << 20


@triton.jit
def _wait_kernel(Sink, nanoseconds, W, nbytes, FUSED: tl.constexpr, CHUNK: tl.constexpr,
                 PER_PROGRAM: tl.constexpr, PDL: tl.constexpr):
    """Spin for `nanoseconds` by the global timer: a stretch in which the bus idles. FUSED:
    first ask for W's first `nbytes` itself (a prefetch inside the kernel before the GEMV,
    as RoPE or attention could, instead of a launch of its own)."""
    pdl_prologue(PDL)
    if FUSED:
        for program in range(0, tl.cdiv(tl.cdiv(nbytes, CHUNK), PER_PROGRAM)):
            l2_prefetch.prefetch_chunks(W, nbytes, program, CHUNK, PER_PROGRAM)
    start = _global_timer(nanoseconds)
    now = start
    while now - start < nanoseconds:
        now = _global_timer(nanoseconds)
    tl.store(Sink, now - start)


@triton.jit
def _global_timer(anything):
    """The GPU's nanosecond clock. (The argument only gives the asm an operand: older Tritons
    want at least one.)"""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [anything],
                                     dtype=tl.int64, is_pure=False, pack=1)


def make_weights(device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    weights = {}
    for name, (n, k) in SHAPES.items():
        bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        weights[f"{name} bf16"] = (bf16, None)
        scale = bf16.float().abs().amax(dim=1, keepdim=True) / 448.0
        weights[f"{name} fp8"] = ((bf16.float() / scale).to(torch.float8_e4m3fn), scale)
    return weights


def copy_rate(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), calls=5)
    return 2 * FLUSH_BYTES / (us * 1e-6)


def chain_us(weight, scale, x, flush, idle_us: float, prefetch_bytes: int, with_gemv: bool,
             warm: bool, fused: bool, sink) -> float:
    src, dst = flush
    launch = pdl_launch(x.device)
    size = weight.numel() * weight.element_size()
    nbytes = min(prefetch_bytes, size) // 16 * 16

    def chain():
        if not warm:
            dst.copy_(src)
        if prefetch_bytes and not fused:
            l2_prefetch.prefetch_l2(weight, prefetch_bytes)
        if idle_us or fused:
            _wait_kernel[(1,)](sink, int(idle_us * 1000), weight.reshape(-1).view(torch.uint8),
                               nbytes, FUSED=fused, CHUNK=l2_prefetch.CHUNK_BYTES,
                               PER_PROGRAM=l2_prefetch.CHUNKS_PER_PROGRAM, **launch)
        if with_gemv:
            gemv(x, weight, scale)

    return min(graph_us(chain, calls=10) for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", default="0,4,8", help="microseconds of idle bus before the GEMV")
    ap.add_argument("--prefetch-mb", default="0,8,16,32,all")
    ap.add_argument("--chunks-kb", default="16", help="bulk prefetch sizes to try")
    ap.add_argument("--weights", default=",".join(f"{n} {d}" for n in SHAPES for d in ("bf16", "fp8")))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    rate = copy_rate(device)
    weights = make_weights(device)
    flush = (torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device),
             torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device))
    sink = torch.zeros(1, dtype=torch.int64, device=device)
    rows = []
    print(f"copy rate {rate / 1e12:.2f} TB/s; PDL {'on' if pdl_launch(device) else 'off'}")
    print(f"{'weight':10s} {'MB':>6s} {'floor':>6s} {'idle':>5s} {'chunk':>6s} {'prefetch':>9s} "
          f"{'chain us':>9s} {'GEMV us':>8s} {'x floor':>7s} {'saved us':>8s}")
    for name in args.weights.split(","):
        weight, scale = weights[name.strip()]
        x = torch.randn(1, weight.shape[1], device=device, dtype=torch.bfloat16)
        size = weight.numel() * weight.element_size()
        floor = size / rate * 2e6  # the copy rate counts read + write; a GEMV only reads
        for idle in (float(v) for v in args.idle.split(",")):
            plans = [("cold", 0, 16, False)]
            for mb in args.prefetch_mb.split(","):
                nbytes = size if mb == "all" else int(float(mb) * (1 << 20))
                if nbytes:
                    label = f"{min(nbytes, size) >> 20} MB"
                    plans += [(label, nbytes, int(kb), False) for kb in args.chunks_kb.split(",")]
                    plans.append((label + " f", nbytes, 16, True))
            plans.append(("warm", 0, 16, False))
            cold = None
            for label, nbytes, chunk_kb, fused in plans:
                l2_prefetch.CHUNK_BYTES = chunk_kb << 10
                warm = label == "warm"
                total = chain_us(weight, scale, x, flush, idle, nbytes, True, warm, fused, sink)
                base = chain_us(weight, scale, x, flush, idle, nbytes, False, warm, fused, sink)
                row = dict(weight=name, mb=size / 2**20, floor_us=floor, idle_us=idle,
                           chunk_kb=chunk_kb, prefetch=label, chain_us=total,
                           gemv_us=total - base)
                cold = total if cold is None else cold
                row["saved_us"] = cold - total
                rows.append(row)
                print(f"{name:10s} {row['mb']:6.1f} {floor:6.1f} {idle:5.1f} {chunk_kb:5d}K "
                      f"{label:>9s} {total:9.1f} {row['gemv_us']:8.1f} "
                      f"{row['gemv_us'] / floor:7.2f} {row['saved_us']:8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_rate=rate, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
