"""Which GEMM library runs the prefill-sized bf16 linears fastest on this GPU?

    python scripts/bench_gemm_libs.py [--ms 512,8192] [--inductor] [--json PATH]

Llama-3-8B's linears (qkv, o, gate_up, down) at each M, timed three ways: cuBLAS (torch's
default for `F.linear`), cuBLASLt (`torch.backends.cuda.preferred_blas_library("cublaslt")`)
and, with `--inductor`, torch.compile's max-autotune (Triton templates against cuBLAS; its
own table is printed). A fourth row per M chains the layer's four GEMMs the way a prefill
step runs them, under each library, in one CUDA graph. Weights are random (std 0.02, as the
dummy loader writes them); four copies are used in turn so L2 does not serve the replays
(the timing is bench_layer_kernels.py's `graph_us`; session 24's table took the best of five
replays instead of their mean).
Prints a table (us and TFLOP/s per cell); `--json` writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_layer_kernels import COPIES, graph_us  # noqa: E402
from bench_layer_kernels import LLAMA_LINEARS as SHAPES  # noqa: E402

LIBS = ("cublas", "cublaslt")


def linear_case(m: int, n: int, k: int):
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    turn = [0]

    def run():
        w = weights[turn[0] % COPIES]
        turn[0] += 1
        torch.matmul(x, w.t(), out=out)
    return run


def layer_chain(m: int):
    """qkv -> o -> gate_up -> down on one layer's shapes (activations reused, not computed)."""
    cases = [linear_case(m, n, k) for n, k in SHAPES.values()]

    def run():
        for case in cases:
            case()
    return run


def set_lib(lib: str) -> None:
    torch.backends.cuda.preferred_blas_library(lib)


def inductor_table(m: int, name: str) -> None:
    import torch._inductor.config as cfg
    cfg.max_autotune_gemm_backends = "ATEN,TRITON"
    if hasattr(cfg.triton, "enable_persistent_tma_matmul"):
        cfg.triton.enable_persistent_tma_matmul = True
    n, k = SHAPES[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda a: F.linear(a, w), mode="max-autotune-no-cudagraphs", dynamic=False)
    fn(x)  # prints inductor's AUTOTUNE table for this shape
    print(f"inductor {name} M={m}: {graph_us(lambda: fn(x), 10):.1f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="512,8192")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for m in ms:
        reps = 20 if m <= 1024 else 4
        for name, (n, k) in list(SHAPES.items()) + [("layer", (0, 0))]:
            row = {"M": m, "linear": name}
            flop = (2 * m * sum(nn * kk for nn, kk in SHAPES.values()) if name == "layer"
                    else 2 * m * n * k)
            for lib in LIBS:
                set_lib(lib)
                fn = layer_chain(m) if name == "layer" else linear_case(m, n, k)
                us = graph_us(fn, reps)
                row[lib] = {"us": us, "tflop_s": flop / us / 1e6}
            rows.append(row)
            print(row, flush=True)
    set_lib("cublas")
    if args.inductor:
        for m in ms:
            for name in ("qkv", "gate_up"):
                try:
                    inductor_table(m, name)
                except Exception as exc:  # report and go on: the table is still useful
                    print(f"inductor {name} M={m} failed: {exc!r}", flush=True)
    print(f"\n{'M':>6} {'linear':>8} " + " ".join(f"{lib + ' us (TF/s)':>22}" for lib in LIBS))
    for r in rows:
        cells = " ".join(f"{r[lib]['us']:>12.1f} ({r[lib]['tflop_s']:>5.0f})      " for lib in LIBS)
        print(f"{r['M']:>6} {r['linear']:>8} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
