"""GPU time of the MoE and FP8 layer kernels against their memory floors, per tile config.

    python scripts/bench_layer_kernels.py [--moe] [--fp8] [--fp8-accum] [--gemv] [--glu] [--quick]
                                          [--json PATH]

MoE (Qwen3-30B-A3B's expert shapes: 128 experts, top-8, hidden 2048, width 768, bf16): per
batch size, the router (torch vs the Triton kernel), the per-pair path and the grouped
path per tile config (each GEMM alone, and the whole layer: routing + experts), against the
floor (bytes of the experts the batch touches, at the measured copy rate) and, at batch
256, a dense GEMM of the same FLOPs (the MoE goal's yardstick). FP8 (Llama-3-8B's linear shapes):
the weight-only kernel per tile config, `torch._scaled_mm` with the activations quantized by
torch and by the Triton kernel, and the bf16 GEMM, against the float8 weight bytes. GEMV
(`--gemv`: Llama-3-8B's and Qwen3-30B-A3B's attention and router linears, bf16, one row):
cuBLAS against the Triton GEMV (engine/kernels/gemv.py) per tile config, against the weight
bytes; launched as the engine launches it (under PDL where available). FP8 accumulation
(`--fp8-accum`, Llama-3-8B's linears at prefill-sized batches): `torch._scaled_mm` with
float32 promotion of the partial sums and with the tensor cores' own accumulation
(`use_fast_accum`, `EngineConfig.fp8_fast_accum`): time, and each one's error against the
float32 product of the same quantized operands, beside the error FP8 quantization itself
makes against the bf16 product. GLU (`--glu`):
Llama-3-8B's gate_up and the SiLU-and-mul after it, bf16 at one row and float8 at 1-16
rows: the two launches the engine ran before (GEMV with split sums + the fused SiLU kernel)
against `gemv_glu` (both in one launch) per tile config.

Every time is a CUDA graph replay of 20 calls (as the engine's decode steps run), so
launch overhead from Python is not counted. Best configs are printed last: they are what
`moe_pair_kernels`, `moe_kernels` and `fp8_kernels` default to.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_offline import measure_ceilings  # noqa: E402

from engine.kernels.moe import pairs as moe_pair_kernels  # noqa: E402
from engine.kernels.fused import silu_and_mul  # noqa: E402
from engine.kernels.gemv import gemv, gemv_glu, glu_config  # noqa: E402
from engine.layers.moe import experts_triton  # noqa: E402
from engine.kernels.moe.align import group_by_expert_kernel  # noqa: E402
from engine.kernels.moe.grouped_gemm import grouped_gemm  # noqa: E402
from engine.kernels.moe.grouped_gemm import tiles_for as moe_tiles_for  # noqa: E402
from engine.kernels.moe.pairs import tiles_for  # noqa: E402
from engine.kernels.tiles import Tiles  # noqa: E402
from engine.kernels.moe.router import softmax_topk  # noqa: E402
from engine.kernels.moe.routing import group_by_expert  # noqa: E402
from engine.quantization import fp8  # noqa: E402
from engine.kernels import fp8 as fp8_kernels  # noqa: E402
from engine.kernels.gemv import w8a16_linear  # noqa: E402

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
COPIES = 4  # weight copies used in turn (see bench_moe)
BLOCK_ROWS = (16, 32, 64, 128)  # expert block sizes tried
LLAMA_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                 "down": (4096, 14336)}


def graph_us(fn, calls: int = 20, replays: int = 5) -> float:
    """Mean GPU time of one `fn()` in microseconds, replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * replays)


def try_time(fn) -> float:
    try:
        return graph_us(fn)
    except Exception as e:  # a config that does not compile or fit: reported, not fatal
        print(f"  config failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return float("inf")


# ------------------------------------------------------------------------------------------ MoE
def moe_case(t: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, E, device="cuda", generator=g).bfloat16()
    weights, ids = softmax_topk(logits, TOP_K, True)
    return x, logits, weights, ids


def bench_moe(bw: float, batches: list[int], quick: bool) -> dict:
    # Copies of the layer's weights, used in turn, as a model's layers are: one copy replayed
    # would serve a decode step's few experts from L2 (50 MB) and beat the floor.
    layers = [((torch.randn(E, 2 * INTER, HIDDEN, device="cuda") / HIDDEN ** 0.5).bfloat16(),
               (torch.randn(E, HIDDEN, INTER, device="cuda") / INTER ** 0.5).bfloat16())
              for _ in range(COPIES)]
    turn = itertools.cycle(layers)
    w13, w2 = layers[0]
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    pair_cfgs = [Tiles(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
        (16, 32, 64), (64, 128, 256), (4,) if quick else (2, 4, 8), (2, 4))]
    gemm_cfgs = [Tiles(128, 64)] + [Tiles(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
        (64, 128), (64, 128), (4,) if quick else (4, 8), (3, 4))]
    rows, best = [], {}
    for t in batches:
        x, logits, weights, ids = moe_case(t)
        touched = torch.unique(ids).numel()
        floor_us = touched * expert_bytes / bw / 1e6
        row = {"tokens": t, "experts_touched": touched, "floor_us": floor_us,
               "router_torch_us": graph_us(lambda: torch.topk(torch.softmax(logits.float(), -1), TOP_K)),
               "router_kernel_us": graph_us(lambda: softmax_topk(logits, TOP_K, True))}
        if t * TOP_K <= 128:  # the per-pair path
            act = torch.empty(t * TOP_K, INTER, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(t * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
            gate = {c: try_time(lambda c=c: launch_gate_up(x, next(turn)[0], ids, act, c)) for c in pair_cfgs}
            down = {c: try_time(lambda c=c: launch_down(act, next(turn)[1], ids, weights, out, c)) for c in pair_cfgs}
            cg, cd = min(gate, key=gate.get), min(down, key=down.get)
            row.update(pair_gate_up_us=gate[cg], pair_down_us=down[cd], pair_gate_up_cfg=str(cg),
                       pair_down_cfg=str(cd), pair_default_us=gate[tiles_for(t)[0]] + down[tiles_for(t)[1]])
            best[f"pair t={t}"] = (cg, cd)
        for block_m in BLOCK_ROWS:
            blocks = group_by_expert(ids, E, 0, block_m)
            # 128-row blocks (long prefills) need the larger tiles' registers: 8 warps too
            cfgs = gemm_cfgs if block_m < 128 else gemm_cfgs + [
                Tiles(bn, bk, 8, ns) for bn, bk, ns in itertools.product((64, 128), (64, 128), (3, 4))]
            gate_up = torch.empty(t * TOP_K, 2 * INTER, device="cuda", dtype=torch.bfloat16)
            act2 = torch.empty(t * TOP_K, INTER, device="cuda", dtype=torch.bfloat16)
            out2 = torch.empty(t * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
            pw = weights.flatten().float().contiguous()
            g1 = {c: try_time(lambda c=c: grouped_gemm(x, next(turn)[0], blocks, gate_up, TOP_K, config=c))
                  for c in cfgs}
            g2 = {c: try_time(lambda c=c: grouped_gemm(act2, next(turn)[1], blocks, out2, 1, pw, config=c))
                  for c in cfgs}
            c1, c2 = min(g1, key=g1.get), min(g2, key=g2.get)
            row[f"grouped_bm{block_m}_us"] = g1[c1] + g2[c2]
            up_tiles, down_tiles = moe_tiles_for(block_m)  # what the layer launches
            row[f"grouped_bm{block_m}_default_us"] = (
                try_time(lambda: grouped_gemm(x, next(turn)[0], blocks, gate_up, TOP_K, config=up_tiles))
                + try_time(lambda: grouped_gemm(act2, next(turn)[1], blocks, out2, 1, pw, config=down_tiles)))
            row[f"grouped_bm{block_m}_cfgs"] = f"{c1} / {c2}"
        row["group_by_expert_us"] = graph_us(lambda: group_by_expert(ids, E, 0, 16))
        row["group_kernel_us"] = graph_us(lambda: group_by_expert_kernel(ids, E, 0, 16))
        row["layer_now_us"] = graph_us(lambda: experts_triton(x, *next(turn), weights, ids))
        saved = moe_pair_kernels.MAX_PAIRS
        moe_pair_kernels.MAX_PAIRS = 0
        row["layer_grouped_default_us"] = graph_us(lambda: experts_triton(x, *next(turn), weights, ids))
        moe_pair_kernels.MAX_PAIRS = saved
        if t == 256:  # the MoE goal's yardstick: the same FLOPs as one dense GEMM pair
            a1 = torch.randn(t * TOP_K, HIDDEN, device="cuda").bfloat16()
            a2 = torch.randn(t * TOP_K, INTER, device="cuda").bfloat16()
            row["dense_same_flops_us"] = graph_us(lambda: (a1 @ w13[0].t(), a2 @ w2[0].t()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "best": {k: [str(c) for c in v] for k, v in best.items()}}


def launch_gate_up(x, w13, ids, act, c: Tiles):
    moe_pair_kernels._gate_up_kernel[(ids.numel(), -(-INTER // c.block_n))](
        x, w13, ids, act, INTER, HIDDEN, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        0, E, TOP_K=TOP_K, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
        num_stages=c.num_stages)


def launch_down(act, w2, ids, weights, out, c: Tiles):
    moe_pair_kernels._down_kernel[(ids.numel(), -(-HIDDEN // c.block_n))](
        act, w2, ids, weights, out, HIDDEN, INTER, act.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), 0, E, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages)
    return out.view(ids.shape[0], TOP_K, HIDDEN).sum(dim=1)


# ------------------------------------------------------------------------------------------ FP8
def bench_fp8(bw: float, batches: list[int], quick: bool) -> dict:
    cfgs = [Tiles(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
        (16, 32, 64, 128), (128, 256, 512), (4,) if quick else (4, 8), (3, 4))]
    # split-K: more programs for one row's long K, a second launch to sum the slices
    cfgs += [Tiles(bn, bk, 4, 4, split_k=sk) for bn, bk, sk in itertools.product(
        (32, 64, 128), (128, 256), (2, 4, 8))]
    rows, best = [], {}
    for name, (n, k) in LLAMA_LINEARS.items():
        dense = [(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for _ in range(COPIES)]
        quantized = [fp8.quantize_rows(w) for w in dense]
        dense_turn, fp8_turn = itertools.cycle(dense), itertools.cycle(quantized)
        for m in batches:
            x = torch.randn(m, k, device="cuda").bfloat16()
            row = {"linear": name, "rows": m, "floor_us": n * k / bw / 1e6,
                   "bf16_us": graph_us(lambda: x @ next(dense_turn).t()),
                   "scaled_mm_torch_quant_us": try_time(lambda: scaled_mm(x, *next(fp8_turn), fp8.quantize_rows)),
                   "scaled_mm_kernel_quant_us": try_time(lambda: scaled_mm(x, *next(fp8_turn), fp8_kernels.quantize_rows))}
            if m <= 32:
                times = {c: try_time(lambda c=c: w8a16_linear(x, *next(fp8_turn), c)) for c in cfgs}
                c = min(times, key=times.get)
                row.update(w8a16_us=times[c], w8a16_cfg=str(c),
                           w8a16_default_us=try_time(lambda: w8a16_linear(x, *next(fp8_turn))))
                best[f"{name} m={m}"] = str(c)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows, "best": best}


def accum_errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, largest error / the reference's RMS) of y against ref."""
    diff = (y.float() - ref)
    rms = ref.pow(2).mean().sqrt()
    return (diff.norm() / ref.norm()).item(), (diff.abs().max() / rms).item()


def bench_fp8_accum(batches: list[int]) -> dict:
    """`_scaled_mm` with and without fast accumulation: time and error (see the docstring)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name, (n, k) in LLAMA_LINEARS.items():
        dense = [(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for _ in range(COPIES)]
        quantized = [fp8.quantize_rows(w) for w in dense]
        turn = itertools.cycle(quantized)
        wq, ws = quantized[0]
        w_exact = wq.float() * ws
        for m, outliers in itertools.product(batches, (False, True)):
            x = torch.randn(m, k, device="cuda")
            if outliers:  # a few hidden channels far above the rest, as LLM activations have
                x[:, torch.randperm(k, device="cuda")[: k // 100]] *= 30.0
            x = x.bfloat16()
            xq, sx = fp8_kernels.quantize_rows(x)
            ref = (xq.float() * sx) @ w_exact.t()  # the quantized operands' exact product
            unquantized = x.float() @ dense[0].float().t()
            row = {"linear": name, "rows": m, "outliers": outliers}
            for label, fast in (("precise", False), ("fast", True)):
                y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=ws.t(), out_dtype=torch.bfloat16,
                                     use_fast_accum=fast)
                row[f"{label}_rel_err"], row[f"{label}_max_err"] = accum_errors(y, ref)
                if not outliers:
                    row[f"{label}_us"] = try_time(lambda fast=fast: _scaled_mm_only(xq, sx, *next(turn), fast))
            row["bf16_rounding_rel_err"], _ = accum_errors(ref.bfloat16(), ref)
            row["fp8_quantization_rel_err"], _ = accum_errors(ref, unquantized)
            if not outliers:
                row["tflops_precise"] = 2 * m * n * k / row["precise_us"] / 1e6
                row["tflops_fast"] = 2 * m * n * k / row["fast_us"] / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows}


def _scaled_mm_only(xq, sx, wq, ws, fast: bool):
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=ws.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast)


MOE_LINEARS = {"moe qkv": (5120, 2048), "moe o": (2048, 4096), "moe router": (128, 2048)}


def gemv_configs(quick: bool) -> list[Tiles]:
    cfgs = [Tiles(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
        (8, 16, 32, 64), (64, 128, 256), (4,) if quick else (2, 4, 8), (3, 4))]
    return cfgs + [Tiles(bn, bk, 4, 4, split_k=sk) for bn, bk, sk in itertools.product(
        (8, 16, 32, 64), (64, 128), (2, 4, 8, 16))]


def bench_gemv(bw: float, quick: bool, batches: list[int]) -> dict:
    """bf16 linears at each row count: cuBLAS against the Triton GEMV's default tiles and
    the sweep's best (rows > 1: what `kernels.bf16_gemv_rows` would switch on)."""
    rows, best = [], {}
    for m in batches:
        linears = {**LLAMA_LINEARS, **MOE_LINEARS} if m == 1 else LLAMA_LINEARS
        for name, (n, k) in linears.items():
            weights = itertools.cycle([(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
                                       for _ in range(COPIES)])
            x = torch.randn(m, k, device="cuda").bfloat16()
            times = {c: try_time(lambda c=c: gemv(x, next(weights), None, c))
                     for c in gemv_configs(quick)}
            c = min(times, key=times.get)
            row = {"linear": name, "rows": m, "floor_us": 2 * n * k / bw / 1e6,
                   "cublas_us": graph_us(lambda: torch.nn.functional.linear(x, next(weights))),
                   "gemv_default_us": try_time(lambda: gemv(x, next(weights))),
                   "gemv_best_us": times[c], "gemv_best_cfg": str(c)}
            best[f"{name} x{m}"] = str(c)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows, "best": best}


def glu_configs(weight_bytes: int, quick: bool) -> list[Tiles]:
    block_ks = (64, 128) if weight_bytes == 2 else (128, 256, 512)
    return [Tiles(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
        (8, 16, 32), block_ks, (4,) if quick else (4, 8), (3, 4))]


def bench_glu(bw: float, quick: bool) -> dict:
    n, k = LLAMA_LINEARS["gate_up"]
    rows, best = [], {}
    for kind, batch in (("bf16", 1), ("fp8", 1), ("fp8", 4), ("fp8", 16)):
        if kind == "bf16":
            weights = [((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16(), None)
                       for _ in range(COPIES)]
        else:
            weights = [tuple(t.cuda() for t in fp8.quantize_rows(torch.randn(n, k) / k ** 0.5))
                       for _ in range(COPIES)]
        cycle = itertools.cycle(weights)
        x = torch.randn(batch, k, device="cuda").bfloat16()

        def two_launches():
            w, s = next(cycle)
            h = gemv(x, w, keep_splits=True) if s is None else \
                w8a16_linear(x, w, s, keep_splits=True)
            return silu_and_mul(h)

        times = {c: try_time(lambda c=c: gemv_glu(x, *next(cycle), c))
                 for c in glu_configs(weights[0][0].element_size(), quick)}
        c = min(times, key=times.get)
        row = {"weights": kind, "rows": batch,
               "floor_us": n * k * weights[0][0].element_size() / bw / 1e6,
               "two_launches_us": graph_us(two_launches),
               "glu_default_us": try_time(lambda: gemv_glu(x, *next(cycle))),
               "glu_default_cfg": str(glu_config(batch, n // 2, k, weights[0][0].element_size())),
               "glu_best_us": times[c], "glu_best_cfg": str(c)}
        best[f"{kind} x{batch}"] = str(c)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "best": best}


def scaled_mm(x, wq, ws, quantize):
    x_q, sx = quantize(x)
    return torch._scaled_mm(x_q, wq.t(), scale_a=sx, scale_b=ws.t(), out_dtype=x.dtype)


def print_tables(res: dict) -> None:
    if "moe" in res:
        print("\nMoE layer (experts only unless noted), us per call, CUDA-graph replay")
        print(f"{'T':>5} {'touched':>7} {'floor':>7} {'router t/k':>11} {'pair best':>9} "
              f"{'pair dflt':>9} {'grp16':>7} {'grp32':>7} {'grp64':>7} {'grp128':>7} {'group t/k':>11} {'now':>7} "
              f"{'grp dflt':>8} {'now/floor':>9}")
        for r in res["moe"]["rows"]:
            pair = r.get("pair_gate_up_us", 0) + r.get("pair_down_us", 0)
            print(f"{r['tokens']:>5} {r['experts_touched']:>7} {r['floor_us']:>7.1f} "
                  f"{r['router_torch_us']:>5.1f}/{r['router_kernel_us']:<5.1f} {pair:>9.1f} "
                  f"{r.get('pair_default_us', 0):>9.1f} {r['grouped_bm16_us']:>7.1f} "
                  f"{r['grouped_bm32_us']:>7.1f} {r['grouped_bm64_us']:>7.1f} {r['grouped_bm128_us']:>7.1f} "
                  f"{r['group_by_expert_us']:>5.1f}/{r['group_kernel_us']:<5.1f} {r['layer_now_us']:>7.1f} "
                  f"{r['layer_grouped_default_us']:>8.1f} {r['layer_now_us'] / r['floor_us']:>9.2f}")
            if "dense_same_flops_us" in r:
                print(f"      dense GEMMs of the same FLOPs: {r['dense_same_flops_us']:.1f} us")
        for r in res["moe"]["rows"]:
            print(f"T={r['tokens']}: " + ", ".join(f"bm{b} {r[f'grouped_bm{b}_cfgs']}" for b in BLOCK_ROWS)
                  + (f"; pair {r['pair_gate_up_cfg']} / {r['pair_down_cfg']}" if "pair_gate_up_cfg" in r else ""))
    if "fp8" in res:
        print("\nFP8 linears (Llama-3-8B), us per call")
        print(f"{'linear':>8} {'M':>4} {'floor':>7} {'bf16':>7} {'w8a16':>7} {'dflt':>7} "
              f"{'smm+tq':>7} {'smm+kq':>7}  best w8a16 config")
        for r in res["fp8"]["rows"]:
            print(f"{r['linear']:>8} {r['rows']:>4} {r['floor_us']:>7.1f} {r['bf16_us']:>7.1f} "
                  f"{r.get('w8a16_us', float('nan')):>7.1f} {r.get('w8a16_default_us', float('nan')):>7.1f} "
                  f"{r['scaled_mm_torch_quant_us']:>7.1f} {r['scaled_mm_kernel_quant_us']:>7.1f}  "
                  f"{r.get('w8a16_cfg', '')}")
    if "fp8_accum" in res:
        print("\nFP8 _scaled_mm (Llama-3-8B linears): float32 promotion vs fast accumulation;"
              " errors against the quantized operands' float32 product")
        print(f"{'linear':>8} {'M':>5} {'outl':>4} {'precise us':>10} {'fast us':>8} {'TF/s p/f':>11} "
              f"{'rel err p':>9} {'rel err f':>9} {'max err p':>9} {'max err f':>9} {'bf16 rnd':>8} {'fp8 q':>7}")
        for r in res["fp8_accum"]["rows"]:
            times = (f"{r['precise_us']:>10.1f} {r['fast_us']:>8.1f} "
                     f"{r['tflops_precise']:>5.0f}/{r['tflops_fast']:<5.0f}" if "fast_us" in r
                     else f"{'':>10} {'':>8} {'':>11}")
            print(f"{r['linear']:>8} {r['rows']:>5} {'yes' if r['outliers'] else 'no':>4} {times} "
                  f"{r['precise_rel_err']:>9.2e} {r['fast_rel_err']:>9.2e} {r['precise_max_err']:>9.2e} "
                  f"{r['fast_max_err']:>9.2e} {r['bf16_rounding_rel_err']:>8.1e} "
                  f"{r['fp8_quantization_rel_err']:>7.1e}")
    if "gemv" in res:
        print("\nbf16 linears, us per call: cuBLAS vs the Triton GEMV")
        print(f"{'linear':>10} {'rows':>4} {'floor':>7} {'cuBLAS':>7} {'default':>7} {'best':>7}  best config")
        for r in res["gemv"]["rows"]:
            print(f"{r['linear']:>10} {r['rows']:>4} {r['floor_us']:>7.1f} {r['cublas_us']:>7.1f} "
                  f"{r['gemv_default_us']:>7.1f} {r['gemv_best_us']:>7.1f}  {r['gemv_best_cfg']}")
    if "glu" in res:
        print("\ngate_up + SiLU-and-mul (Llama-3-8B), us per call: two launches vs gemv_glu")
        print(f"{'weights':>7} {'rows':>4} {'floor':>7} {'2 launch':>8} {'glu dflt':>8} {'glu best':>8}  best config")
        for r in res["glu"]["rows"]:
            print(f"{r['weights']:>7} {r['rows']:>4} {r['floor_us']:>7.1f} {r['two_launches_us']:>8.1f} "
                  f"{r['glu_default_us']:>8.1f} {r['glu_best_us']:>8.1f}  {r['glu_best_cfg']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--fp8-accum", action="store_true",
                    help="FP8 _scaled_mm: float32 promotion vs fast accumulation, time and error")
    ap.add_argument("--fp8-accum-batches", default="128,479,2048,8192")
    ap.add_argument("--gemv", action="store_true", help="bf16 linears: cuBLAS vs Triton")
    ap.add_argument("--gemv-rows", default="1", help="--gemv's row counts, e.g. 1,16,32,64")
    ap.add_argument("--glu", action="store_true", help="gate_up + SiLU: two launches vs gemv_glu")
    ap.add_argument("--quick", action="store_true", help="fewer tile configs")
    ap.add_argument("--moe-batches", default="1,4,8,16,64,256,480,2048,8192")
    ap.add_argument("--fp8-batches", default="1,4,16,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_layer_kernels.py needs a CUDA GPU")
    bw = measure_ceilings()["copy_tb_s"]  # as bench_offline's floors
    print(f"copy rate {bw:.2f} TB/s", flush=True)
    res = {"copy_tb_s": bw}
    everything = not (args.moe or args.fp8 or args.fp8_accum or args.gemv or args.glu)
    if args.moe or everything:
        res["moe"] = bench_moe(bw, [int(b) for b in args.moe_batches.split(",")], args.quick)
    if args.fp8 or everything:
        res["fp8"] = bench_fp8(bw, [int(b) for b in args.fp8_batches.split(",")], args.quick)
    if args.fp8_accum or everything:
        res["fp8_accum"] = bench_fp8_accum([int(b) for b in args.fp8_accum_batches.split(",")])
    if args.gemv or everything:
        res["gemv"] = bench_gemv(bw, args.quick, [int(m) for m in args.gemv_rows.split(",")])
    if args.glu or everything:
        res["glu"] = bench_glu(bw, args.quick)
    print_tables(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
