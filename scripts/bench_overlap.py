"""Can a decode step's attention run beside its GEMMs? (H200; the question W1's goal turns on.)

A W1 decode step at ~480 requests is ~10 ms of GEMMs, bound by the tensor cores, and ~13 ms
of attention, bound by reading K/V, run one after the other; a model of W1's steps from the
real scheduler puts the whole run at ~18 s of GEMMs, ~7 s of attention and ~3 s of other
work (benchmarks/RESULTS.md, session 25). Even with every GEMM at the machine's peak the
sum (25.3 s) stays above the 24.7 s that 11,000 tok/s allows; run side by side (the batch cut in
two, one half's attention while the other half's GEMMs run, as NanoFlow does), the two could
take about the longer of them.

This times one layer's pieces for half a W1 batch, each replayed from a CUDA graph: the
engine's Triton decode attention (`--batch` requests of `--context` tokens, Llama-3-8B's
heads, a fresh layer of the pool each call) and the layer's four GEMMs at as many rows
(cuBLAS), alone, one after the other, and on two streams at once; with `--carveouts`, cuBLAS
also told to leave that many multiprocessors free (torch's experimental SM carve-out, where
this torch has it). "overlap" is the share of the shorter piece hidden: (A + G - both) /
min(A, G); 1.0 means the pair took as long as its longer piece.

    python3 scripts/bench_overlap.py [--batch 240] [--context 850] [--carveouts 0,16,32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from bench_layer_kernels import LLAMA_LINEARS  # noqa: E402
from check_attention import D, DT, decode_batch, decode_layers, graph_time_us  # noqa: E402

LAYERS = 4  # pool layers cycled through, so K/V come from HBM as in a step


def two_streams(first, second):
    """Run `first` and `second` on two side streams, joined back into the current one."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream, fn in zip(streams, (first, second)):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
    for stream in streams:
        main.wait_stream(stream)


def set_carveout(sms: int) -> bool:
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        return sms == 0
    setter(sms if sms else None)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=240, help="requests (half of W1's ~480)")
    ap.add_argument("--context", type=int, default=850, help="tokens of K/V per request")
    ap.add_argument("--carveouts", default="0,16,32", help="multiprocessors cuBLAS leaves free")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pool, batch, q, k, v = decode_batch(args.batch, args.context, LAYERS, contiguous=False)
    attention, _ = decode_layers(pool, batch, q, k, v, LAYERS, graph_mode=True)

    weights = [[torch.randn(n, kk, device="cuda", dtype=DT) * 0.02 for n, kk in LLAMA_LINEARS.values()]
               for _ in range(LAYERS)]
    inputs = [torch.randn(args.batch, kk, device="cuda", dtype=DT) for _, kk in LLAMA_LINEARS.values()]
    turn = {"i": 0}

    def gemms():
        for x, w in zip(inputs, weights[turn["i"] % LAYERS]):
            torch.nn.functional.linear(x, w)
        turn["i"] += 1

    kv_bytes = 2 * args.batch * args.context * pool.k[0].shape[1] * D * pool.k[0].element_size()
    flops = sum(2 * args.batch * n * kk for n, kk in LLAMA_LINEARS.values())
    rows = []
    print(f"batch {args.batch} x {args.context} tokens: K/V {kv_bytes / 2**20:.0f} MB a layer, "
          f"GEMMs {flops / 1e9:.0f} GFLOP a layer")
    print(f"{'carve-out':>9} {'attn us':>8} {'GEMMs us':>9} {'serial us':>10} {'2 streams us':>13} {'overlap':>8}")
    for sms in (int(s) for s in args.carveouts.split(",")):
        if not set_carveout(sms):
            print(f"{sms:>9} (this torch has no SM carve-out)")
            continue
        a = graph_time_us(attention, LAYERS)
        g = graph_time_us(gemms, LAYERS)
        serial = graph_time_us(lambda: (attention(), gemms()), LAYERS)
        both = graph_time_us(lambda: two_streams(attention, gemms), LAYERS)
        overlap = (a + g - both) / min(a, g)
        rows.append(dict(carveout=sms, attention_us=a, gemms_us=g, serial_us=serial,
                         two_streams_us=both, overlap=overlap,
                         kv_tb_s=kv_bytes / a / 1e6, gemm_tflop_s=flops / g / 1e6))
        print(f"{sms:>9} {a:8.1f} {g:9.1f} {serial:10.1f} {both:13.1f} {overlap:8.2f}", flush=True)
    set_carveout(0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(batch=args.batch, context=args.context, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
