"""Correctness checks and timings of the Triton attention backend (GPU).

    PYTHONUNBUFFERED=1 python3 scripts/check_attention.py [--sweep] [--skip-checks]

1. Runs every case of tests/test_triton_attention.py (decode / extend / padded / CUDA graph)
   against the fp32 torch reference.
2. Measures the copy bandwidth and bf16 matmul ceilings.
3. Times the decode path per layer (store K/V + split-KV partials + reduce, in a CUDA graph,
   L2 flushed by do_bench before each replay) at Llama-3-8B shapes (32 q heads, 8 KV heads,
   head_dim 128, bf16), with achieved KV-read bandwidth = bytes of K+V read / time.
4. Times the extend path (8 x 512 new, no prefix; 1 x 128 new on a 2048 prefix): TFLOP/s.
--sweep also times kernel configs and split counts and reports the best. --kv-dtype fp8_e4m3
times the same shapes on a float8 pool (bandwidths count its bytes; the checks are skipped).
Prints a table last; writes JSON to $OUT/attention_bench_<kv dtype>.json (or ./).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from engine.attention.base import ForwardBatch  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.attention.kv_pool import KVPool  # noqa: E402

HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
KV_DT = DT  # the pool's dtype: --kv-dtype
# (480, 800): a W1 decode step (about 480 running, contexts of about 800 tokens)
DECODE_SHAPES = [(1, 768), (64, 1024), (256, 2048), (480, 800), (512, 2300)]
EXTEND_SHAPES = [("8x512_p0", [(0, 512)] * 8), ("1x128_p2048", [(2048, 128)])]
# Long prompts' chunks (the long-prefill benchmark's): --extend-shapes long
LONG_EXTEND_SHAPES = [("1x8192_p0", [(0, 8192)]), ("1x8192_p8192", [(8192, 8192)]),
                      ("2x8192_p0", [(0, 8192)] * 2), ("8x2048_p0", [(0, 2048)] * 8)]
DECODE_CFGS = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
               for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)] + \
              [dict(BLOCK_N=64, num_warps=4, num_stages=1), dict(BLOCK_N=64, num_warps=4, num_stages=4),
               dict(BLOCK_N=128, num_warps=4, num_stages=4), dict(BLOCK_N=256, num_warps=4, num_stages=2),
               dict(BLOCK_N=256, num_warps=8, num_stages=2), dict(BLOCK_N=256, num_warps=4, num_stages=3),
               dict(BLOCK_N=256, num_warps=8, num_stages=3)]
EXTEND_CFGS = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for (m, n, w, s) in [
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2),
    (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 2),
    (128, 128, 8, 1), (128, 32, 8, 3), (64, 128, 4, 3), (128, 64, 4, 2)]]


def graph_time_us(fn, n_inner: int) -> float:
    """Median µs of one call of fn, from a CUDA graph of n_inner calls (L2 flushed by do_bench
    before each replay)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_inner):
            fn()
    torch.cuda.synchronize()
    ms = do_bench(g.replay, warmup=25, rep=150, return_mode="median")
    return ms * 1e3 / n_inner


def random_pool(num_slots: int, layers: int) -> KVPool:
    pool = KVPool(num_slots, layers, HKV, D, KV_DT, "cuda")
    for t in pool.k + pool.v:
        for chunk in t.split(1 << 18):  # bf16 noise, cast (no float8 normal_), in pieces
            chunk.copy_(torch.randn(chunk.shape, dtype=DT, device="cuda"))
    return pool


def decode_batch(bsz: int, seqlen: int, layers: int, contiguous: bool) -> tuple:
    total = bsz * seqlen
    num_slots = total + 16
    pool = random_pool(num_slots, layers)
    if contiguous:
        slots = torch.arange(1, total + 1, device="cuda")
    else:
        slots = torch.randperm(num_slots, device="cuda")[:total] + 1
    r2t = torch.zeros(bsz + 1, seqlen + 8, dtype=torch.int32, device="cuda")
    r2t[1:, :seqlen] = slots.view(bsz, seqlen).to(torch.int32)
    rows = torch.arange(1, bsz + 1, device="cuda")
    batch = ForwardBatch(
        input_ids=torch.zeros(bsz, dtype=torch.int64, device="cuda"),
        positions=torch.full((bsz,), seqlen - 1, dtype=torch.int64, device="cuda"),
        out_slots=r2t[1:, seqlen - 1].long(),
        req_rows=rows,
        seq_lens=torch.full((bsz,), seqlen, dtype=torch.int32, device="cuda"),
        extend_lens=torch.ones(bsz, dtype=torch.int32, device="cuda"),
        qo_indptr=torch.arange(bsz + 1, dtype=torch.int32, device="cuda"),
        logits_indices=torch.arange(bsz, device="cuda"),
        req_to_token=r2t, is_decode=True,
        seq_lens_cpu=[seqlen] * bsz, extend_lens_cpu=[1] * bsz)
    qkv = torch.randn(bsz, (HQ + 2 * HKV) * D, device="cuda", dtype=DT)
    q = qkv[:, :HQ * D].view(bsz, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(bsz, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(bsz, HKV, D)
    return pool, batch, q, k, v


def decode_layers(pool, batch, q, k, v, layers, cfg=None, splits=None, graph_mode=False):
    """(fn, backend): each fn() runs the decode path of the next of `layers` pool layers."""
    be = TritonAttentionBackend(pool, D ** -0.5, force_num_splits=splits, graph_mode=graph_mode)
    if cfg:
        be.decode_cfg = dict(cfg)
    be.prepare(batch)
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    state = {"l": 0}

    def fn():
        be.forward(q, k, v, state["l"] % layers, batch, out=out)
        state["l"] += 1
    return fn, be


def time_decode(pool, batch, q, k, v, layers, cfg=None, splits=None,
                graph_mode=False) -> tuple[float, int]:
    fn, be = decode_layers(pool, batch, q, k, v, layers, cfg, splits, graph_mode)
    return graph_time_us(fn, layers), be._num_splits


def extend_batch(reqs, layers=1):
    total = sum(p + e for p, e in reqs)
    num_slots = total + 16
    pool = random_pool(num_slots, layers)
    bsz = len(reqs)
    max_ctx = max(p + e for p, e in reqs)
    slots = torch.randperm(num_slots, device="cuda")[:total] + 1
    r2t = torch.zeros(bsz + 1, max_ctx + 8, dtype=torch.int32, device="cuda")
    out_slots, cur = [], 0
    for i, (p, e) in enumerate(reqs):
        r2t[i + 1, :p + e] = slots[cur:cur + p + e].to(torch.int32)
        out_slots.append(slots[cur + p:cur + p + e])
        cur += p + e
    ext = [e for _, e in reqs]
    qo = [0]
    for e in ext:
        qo.append(qo[-1] + e)
    T = qo[-1]
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.int64, device="cuda"),
        positions=torch.zeros(T, dtype=torch.int64, device="cuda"),
        out_slots=torch.cat(out_slots).long(),
        req_rows=torch.arange(1, bsz + 1, device="cuda"),
        seq_lens=torch.tensor([p + e for p, e in reqs], dtype=torch.int32, device="cuda"),
        extend_lens=torch.tensor(ext, dtype=torch.int32, device="cuda"),
        qo_indptr=torch.tensor(qo, dtype=torch.int32, device="cuda"),
        logits_indices=torch.tensor(qo[1:], device="cuda") - 1,
        req_to_token=r2t, is_decode=False,
        seq_lens_cpu=[p + e for p, e in reqs], extend_lens_cpu=ext)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, device="cuda", dtype=DT)
    q = qkv[:, :HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(T, HKV, D)
    return pool, batch, q, k, v


def extend_flops(reqs) -> float:
    keys = sum(e * p + e * (e + 1) / 2 for p, e in reqs)  # (query, key) pairs attended
    return 4.0 * HQ * D * keys


def extend_reference(pool, batch, q, k, v) -> torch.Tensor:
    from engine.attention.torch_backend import TorchAttentionBackend

    ref_pool = KVPool.over([pool.k[0].float()], [pool.v[0].float()])
    if pool.fp8:  # the new tokens as the pool holds them
        k, v = (pool.decode(pool.encode(x), x.dtype) for x in (k, v))
    return TorchAttentionBackend(ref_pool, D ** -0.5).forward(q.float(), k.float(), v.float(),
                                                              0, batch)


def time_extend(pool, batch, q, k, v, cfg=None, ref=None) -> tuple[float, float]:
    """(µs, relative error against ref, NaN when no ref)."""
    be = TritonAttentionBackend(pool, D ** -0.5)
    if cfg:
        be.extend_cfg = dict(cfg)
    be.prepare(batch)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    us = graph_time_us(lambda: be.forward(q, k, v, 0, batch, out=out), 4)
    rel = float("nan")
    if ref is not None:
        rel = float((out.float() - ref).norm() / ref.norm())
    return us, rel


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    bw = 2 * n / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return dict(copy_TBps=bw / 1e12, mm_TFLOPs=2 * 8192 ** 3 / (ms * 1e-3) / 1e12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", choices=["none", "decode", "extend", "all"], default="none")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--extend-shapes", choices=["short", "long"], default="short")
    ap.add_argument("--no-decode", action="store_true", help="time the extend shapes only")
    ap.add_argument("--no-extend", action="store_true", help="time the decode shapes only")
    ap.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16")
    args = ap.parse_args()
    global KV_DT
    KV_DT = KV_DTYPES[args.kv_dtype]
    if KV_DT != DT:
        args.skip_checks = True  # the checks build their own pools: tests/test_triton_attention.py
    extend_shapes = LONG_EXTEND_SHAPES if args.extend_shapes == "long" else EXTEND_SHAPES
    assert torch.cuda.is_available(), "needs a GPU"
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    res: dict = dict(date=time.strftime("%Y-%m-%d"), device=props.name, kv_dtype=args.kv_dtype,
                     checks=[], decode=[], extend=[])
    t0 = time.time()
    all_ok = True
    if not args.skip_checks:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from test_triton_attention import all_checks
        for name, r in all_checks():
            all_ok &= r["ok"]
            res["checks"].append(dict(name=name, **r))
            print(f"check {name:28s} rel={r['rel']:.2e} tol={r['tol']:.0e} nan={r['nan']} "
                  f"pool={r['pool_ok']} {'OK' if r['ok'] else 'FAIL'}")
        print(f"checks done in {time.time() - t0:.0f}s, all ok: {all_ok}")
    ceil = ceilings()
    res["ceilings"] = ceil
    print(f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, bf16 mm {ceil['mm_TFLOPs']:.0f} TFLOP/s")
    bw_ref = 4.3e12

    for bsz, seqlen in [] if args.no_decode else DECODE_SHAPES:
        kv_bytes = bsz * seqlen * HKV * D * 2 * KV_DT.itemsize
        layers = max(1, min(8, int(2e9 // kv_bytes)))
        pool, batch, q, k, v = decode_batch(bsz, seqlen, layers, contiguous=False)
        us, splits = time_decode(pool, batch, q, k, v, layers)
        row = dict(bsz=bsz, seqlen=seqlen, layers=layers, kv_MB=kv_bytes / 1e6, us=us,
                   splits=splits, floor_us=kv_bytes / bw_ref * 1e6,
                   TBps=kv_bytes / (us * 1e-6) / 1e12)
        if args.sweep in ("decode", "all"):
            best = (us, None, splits)
            sweep = []
            for cfg in DECODE_CFGS:
                try:
                    t, s = time_decode(pool, batch, q, k, v, layers, cfg=cfg)
                except Exception as e:  # e.g. out of shared memory
                    print("  cfg", cfg, "failed:", type(e).__name__, str(e)[:100])
                    continue
                sweep.append(dict(cfg=cfg, splits=s, us=t))
                if t < best[0]:
                    best = (t, cfg, s)
            for s in (1, 2, 3, 4, 6, 8, 16, 32):
                t, s2 = time_decode(pool, batch, q, k, v, layers, cfg=best[1], splits=s)
                sweep.append(dict(cfg=best[1], splits=s2, us=t))
                if t < best[0]:
                    best = (t, best[1], s2)
            row["sweep"] = sweep
            row["best"] = dict(us=best[0], cfg=best[1], splits=best[2],
                               TBps=kv_bytes / (best[0] * 1e-6) / 1e12)
            print(f"  decode b{bsz} s{seqlen}: best {best[0]:.1f} us cfg={best[1]} splits={best[2]}")
            for e in sorted(sweep, key=lambda e: e["us"])[:5]:
                print(f"    {e['us']:8.1f} us  splits={e['splits']:2d} cfg={e['cfg']}")
        if bsz <= 64:
            row["us_graph_mode"], row["splits_graph_mode"] = time_decode(
                pool, batch, q, k, v, layers, graph_mode=True)
        del pool
        pool, batch, q, k, v = decode_batch(bsz, seqlen, layers, contiguous=True)
        row["us_contig_slots"], _ = time_decode(pool, batch, q, k, v, layers)
        del pool, batch, q, k, v
        torch.cuda.empty_cache()
        res["decode"].append(row)
        print(f"decode b{bsz} s{seqlen}: {us:.1f} us (splits {splits}), "
              f"{row['TBps']:.2f} TB/s, contiguous slots {row['us_contig_slots']:.1f} us, "
              f"graph_mode {row.get('us_graph_mode', float('nan')):.1f} us "
              f"(splits {row.get('splits_graph_mode')})")

    for name, reqs in [] if args.no_extend else extend_shapes:
        pool, batch, q, k, v = extend_batch(reqs)
        flops = extend_flops(reqs)
        ref = extend_reference(pool, batch, q, k, v)
        us, rel = time_extend(pool, batch, q, k, v, ref=ref)
        row = dict(name=name, us=us, rel=rel, GFLOP=flops / 1e9, TFLOPs=flops / (us * 1e-6) / 1e12,
                   floor_us=flops / (ceil["mm_TFLOPs"] * 1e12) * 1e6)
        print(f"extend {name}: {us:.1f} us rel={rel:.1e}")
        if args.sweep in ("extend", "all"):
            sweep = []
            for cfg in EXTEND_CFGS:
                try:
                    t, r = time_extend(pool, batch, q, k, v, cfg=cfg, ref=ref)
                except Exception as e:
                    print("  cfg", cfg, "failed:", type(e).__name__, str(e)[:100])
                    continue
                sweep.append(dict(cfg=cfg, us=t, rel=r, ok=r < 1e-2))
            sweep.sort(key=lambda e: e["us"] if e["ok"] else float("inf"))
            row["sweep"] = sweep
            for e in sweep:
                print(f"    extend {name}: {e['us']:8.1f} us rel={e['rel']:.1e} cfg={e['cfg']}")
        if name == "8x512_p0":  # torch's own flash attention on the same dense problem
            qd = torch.randn(8, HQ, 512, D, device="cuda", dtype=DT)
            kd = torch.randn(8, HKV, 512, D, device="cuda", dtype=DT)
            vd = torch.randn(8, HKV, 512, D, device="cuda", dtype=DT)
            f = torch.nn.functional.scaled_dot_product_attention
            ms = do_bench(lambda: f(qd, kd, vd, is_causal=True, enable_gqa=True),
                          warmup=25, rep=100, return_mode="median")
            row["torch_sdpa_us"] = ms * 1e3
        res["extend"].append(row)
        del pool, batch, q, k, v
        torch.cuda.empty_cache()

    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, f"attention_bench_{args.kv_dtype}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)

    print()
    print(f"checks: {len(res['checks'])} run, all ok: {all_ok}")
    print(f"| decode (32q/8kv/128, {args.kv_dtype} pool) | KV MB | floor us @4.3TB/s | us | splits | TB/s | "
          "ratio | contig-slots us | graph-mode us (splits) | best sweep us |")
    for r in res["decode"]:
        best = r.get("best", {}).get("us", float("nan"))
        print(f"| b{r['bsz']} s{r['seqlen']} | {r['kv_MB']:.1f} | {r['floor_us']:.1f} | "
              f"{r['us']:.1f} | {r['splits']} | {r['TBps']:.2f} | {r['us'] / r['floor_us']:.2f} | "
              f"{r['us_contig_slots']:.1f} | {r.get('us_graph_mode', float('nan')):.1f} "
              f"({r.get('splits_graph_mode', '-')}) | {best:.1f} |")
    print(f"| extend (32q/8kv/128, {args.kv_dtype} pool) | GFLOP | floor us @mm | us | TFLOP/s | rel err | "
          "best sweep us | torch sdpa us |")
    for r in res["extend"]:
        best = r["sweep"][0]["us"] if r.get("sweep") else float("nan")
        print(f"| {r['name']} | {r['GFLOP']:.2f} | {r['floor_us']:.1f} | {r['us']:.1f} | "
              f"{r['TFLOPs']:.0f} | {r['rel']:.1e} | {best:.1f} | "
              f"{r.get('torch_sdpa_us', float('nan')):.1f} |")
    print(f"total {time.time() - t0:.0f}s")
    all_ok &= all(r["rel"] < 1e-2 for r in res["extend"])
    if not all_ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
