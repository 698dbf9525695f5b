"""A GEMM for decode-sized batches (a few rows): y = x W^T, bound by reading W once.

Float8 weights (one scale per output row, `engine.kernels.fp8.w8a16_linear`)
and, at batch 1, bf16 weights (`LinearBase.gemv_rows`): there the kernel
matches cuBLAS on the weight bytes and, launched under PDL (engine/kernels/launch.py), chains
with the layer's other Triton kernels instead of breaking the chain at every linear.

One row multiplies on the CUDA cores (a tl.dot needs 16); a K much longer than N is cut into
slices (`Tiles.split_k`), one program each, summed by a second launch or by the consumer
(engine/kernels/split_sums.py). Also runs under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from engine.kernels.inline import add_split_sums, silu_mul
from engine.kernels.launch import pdl_launch, pdl_prologue, setting_on, split_sums_on
from engine.kernels.split_sums import SplitSums
from engine.kernels.tiles import Tiles



def gemv_config(rows: int, n: int, k: int, weight_bytes: int = 1) -> Tiles:
    """Tiles by shape and weight width, from scripts/bench_layer_kernels.py on the H200."""
    if weight_bytes == 1:
        return _fp8_tiles(rows, n, k)
    if rows == 1:
        return _bf16_row_tiles(n)
    if weight_bytes == 2:
        return _bf16_rows_tiles(n, k)
    # float32 weights (tests under the interpreter): K steps of the float8 tiles' bytes
    tiles = _fp8_tiles(rows, n, k)
    return dataclasses.replace(tiles, block_k=max(32, tiles.block_k // weight_bytes))


def _bf16_row_tiles(n: int) -> Tiles:
    """One row, bf16 weights (`--gemv`; Llama-3-8B and Qwen3-30B-A3B linears):
    every shape's fastest cuts K into 4 slices of 128-wide steps, with row blocks as thin as
    keep a few programs per multiprocessor busy. Against cuBLAS, us: qkv 14.9 / 16.0, o 10.9 /
    13.4, gate_up 58.1 / 57.1, down 30.9 / 32.0; MoE qkv 7.6 / 8.2, o 7.7 / 9.3, router
    2.4 / 4.7."""
    block_n = 32 if n >= 5120 else 16 if n >= 4096 else 8
    return Tiles(block_n=block_n, block_k=128, num_stages=4, split_k=4)


def _bf16_rows_tiles(n: int, k: int) -> Tiles:
    """2-64 rows of bf16 weights, taken only when `kernels.bf16_gemv_rows` raises the rows
    (engine/layers/__init__.py). Not yet swept on a GPU (`bench_layer_kernels.py --gemv
    --gemv-rows 16,32,64`): 128-wide K steps keep a 64-row activation tile and the weight's
    in shared memory over four stages (96 KB), and K is cut where the output alone leaves
    fewer than ~2 programs per multiprocessor."""
    if k >= 3 * n:
        return Tiles(block_n=32, block_k=128, num_stages=4, split_k=4)
    if n >= 16384:
        return Tiles(block_n=32, block_k=128, num_stages=4)
    return Tiles(block_n=32, block_k=128, num_stages=4, split_k=2)


def _fp8_tiles(rows: int, n: int, k: int) -> Tiles:
    """Float8 weights (Llama-3-8B linears): wide outputs have programs to spare
    and take short K steps on the CUDA cores; at one row the narrower ones (qkv, o, down)
    multiply on the tensor cores in f16 (`row_dot`; H200, us: qkv 10.6 -> 9.5, o 9.3 -> 7.6,
    down 19.9 -> 17.6, gate_up 33.5 on the CUDA cores vs 35.1); above one row each shape the
    sweep's fastest for qkv (n > k) and o (n == k). `kernels.fp8_row_dot` off: one row on
    the CUDA cores."""
    if rows == 1 and setting_on("fp8_row_dot") and n < 16384:
        return Tiles(block_n=64, block_k=256 if k >= 3 * n else 128, num_stages=4, split_k=4,
                     row_dot=True)
    if k >= 3 * n:
        if rows == 1:
            return Tiles(block_n=64, block_k=128, num_stages=4, split_k=8)
        return Tiles(block_n=32, block_k=128 if rows <= 4 else 256, num_stages=4, split_k=4)
    if n >= 16384:
        return Tiles(block_n=32, block_k=128 if rows <= 4 else 256, num_stages=4 if rows <= 4 else 3)
    if rows == 1:
        return Tiles(block_n=16, block_k=512, num_stages=4)
    if rows <= 4:
        return Tiles(block_n=32, block_k=128, num_stages=4, split_k=4 if n > k else 2)
    if n > k:
        return Tiles(block_n=32, block_k=256, num_stages=4, split_k=2)
    return Tiles(block_n=32, block_k=512, num_stages=3)


# One-row float8 GEMV on the tensor cores: activations times 2^-4 before their f16 cast.
# Passed as a runtime argument: as a constant, LLVM turned the float32 multiply of the
# widened bf16 into an f16 multiply after the cast, so activations past 65,504 became inf
# (H200, Triton 3.6).
ROW_DOT_SCALE = 0.0625
ROW_DOT_UNSCALE = tl.constexpr(16.0)


@triton.jit
def _gemv_kernel(X, W, Scale, Out, M, N, K, k_per_split, stride_xm, stride_wn, stride_om, row_scale,
                 stride_s, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr = True,
                 ROW_DOT: tl.constexpr = False, GLU: tl.constexpr = False,
                 SCALE_GROUP: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program (n block, K slice). With SPLIT_K > 1, Out is float32 [SPLIT_K, M, N] partial
    sums (scaled) that `_sum_splits_kernel` adds up. With GLU, W is [gate; up] ([2N, K]) and
    the program multiplies its rows of both: Out = silu(x gate^T) * (x up^T), [M, N].
    SCALE_GROUP > 0: block-scaled float8 weights, Scale [N, K / SCALE_GROUP] (row stride
    stride_s), one scale per SCALE_GROUP-wide run of a row; BLOCK_K divides SCALE_GROUP and
    the K slices start at multiples of BLOCK_K, so each step reads within one group."""
    pdl_prologue(PDL)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    if GLU:
        # gate and up rows interleaved, so one loop streams both and they split apart after
        r = tl.arange(0, 2 * BLOCK_N)
        cols = tl.program_id(0) * BLOCK_N + r // 2
        both = _rows_times_x(X, W, Scale, cols + (r % 2) * N, cols < N, M, k_start, k_end,
                             stride_xm, stride_wn, row_scale, stride_s, PRECISION, BLOCK_M,
                             2 * BLOCK_N, BLOCK_K, HAS_SCALE, ROW_DOT, SCALE_GROUP)
        gate, up = tl.split(tl.reshape(both, (BLOCK_M, BLOCK_N, 2)))
        dtype = Out.dtype.element_ty
        acc = silu_mul(gate.to(dtype), up.to(dtype))
    else:
        acc = _rows_times_x(X, W, Scale, offs_n, n_mask, M, k_start, k_end, stride_xm,
                            stride_wn, row_scale, stride_s, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                            HAS_SCALE, ROW_DOT, SCALE_GROUP)
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K > 1:
        out_ptrs += tl.program_id(1) * M * N
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _rows_times_x(X, W, Scale, rows, row_mask, M, k_start, k_end, stride_xm, stride_wn,
                  row_scale, stride_s, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                  ROW_DOT: tl.constexpr, SCALE_GROUP: tl.constexpr):
    """x[:, k_start:k_end] times W's BLOCK_N rows `rows` over the same K range (scaled by
    their weight scales: per row at the end, or per K step with SCALE_GROUP): float32
    [BLOCK_M, BLOCK_N]."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_ptrs = X + offs_m[:, None] * stride_xm + k_start + offs_k[None, :]
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + k_start + offs_k[None, :]
    if ROW_DOT:  # one row, float8 weights: a 16-row f16 tl.dot whose rows 1..15 are zeros
        rows16 = tl.arange(0, 16)
        x_ptrs = X + rows16[:, None] * 0 + k_start + offs_k[None, :]
        acc16 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_mask = offs_k < k_end - k0
            x = tl.load(x_ptrs, mask=(rows16[:, None] == 0) & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            # f16 holds every float8 weight exactly, and bf16 activations exactly from 2^-10
            # to 2^20 once scaled by 2^-4 (f16's normal range is 2^-14 to 65504)
            xs = (x.to(tl.float32) * row_scale).to(tl.float16)
            if SCALE_GROUP > 0:
                acc16 += tl.dot(xs, tl.trans(w.to(tl.float16))) * _group_scales(
                    Scale, rows, row_mask, stride_s, k0, SCALE_GROUP)[None, :]
            else:
                acc16 = tl.dot(xs, tl.trans(w.to(tl.float16)), acc16)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = tl.sum(acc16, axis=0)[None, :] * ROW_DOT_UNSCALE
    elif BLOCK_M == 1:  # one row: multiply-add on the CUDA cores, reduce once at the end
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_mask = offs_k < k_end - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if SCALE_GROUP > 0:
                s = _group_scales(Scale, rows, row_mask, stride_s, k0, SCALE_GROUP)
                acc2 += (w.to(tl.float32) * s[:, None]) * x.to(tl.float32)
            else:
                acc2 += w.to(tl.float32) * x.to(tl.float32)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_mask = offs_k < k_end - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if SCALE_GROUP > 0:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION) * \
                    _group_scales(Scale, rows, row_mask, stride_s, k0, SCALE_GROUP)[None, :]
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if HAS_SCALE and SCALE_GROUP == 0:
        acc = acc * tl.load(Scale + rows, mask=row_mask, other=0.0)[None, :]
    return acc


@triton.jit
def _group_scales(Scale, rows, row_mask, stride_s, k0, SCALE_GROUP: tl.constexpr):
    """The scales of `rows` for the group holding K offset k0 (block-scaled weights)."""
    return tl.load(Scale + rows.to(tl.int64) * stride_s + k0 // SCALE_GROUP, mask=row_mask,
                   other=0.0)


@triton.jit
def _sum_splits_kernel(Partial, Out, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    total = add_split_sums(Partial + offs, mask, size, SPLIT_K, Out.dtype.element_ty)
    tl.store(Out + offs, total, mask=mask)


def sum_splits(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 partial sums [S, M, N] -> their sum [M, N] in `dtype`."""
    splits, m, n = parts.shape
    out = torch.empty((m, n), dtype=dtype, device=parts.device)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](parts, out, m * n, SPLIT_K=splits,
                                                     BLOCK=block, **pdl_launch(parts.device))
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
         config: Tiles | None = None, keep_splits: bool = False) -> torch.Tensor | SplitSums:
    """x [M, K] (bf16/fp16/fp32) times weight [N, K] (float8 with weight_scale float32 [N, 1],
    or x's dtype without) -> [M, N] in x's dtype. M is small (decode): the whole batch is one
    row block. With `keep_splits`, a K cut into slices comes back as their partial sums,
    for a consumer that adds them itself."""
    m, k = x.shape
    n = weight.shape[0]
    config = fit_scale_groups(config or gemv_config(m, n, k, weight.element_size()), k, weight_scale)
    # K slices whole in BLOCK_K steps, so only the last slice is ragged
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _launch(x, weight, weight_scale, out, n, k_per_split, split_k, config, glu=False)
    if split_k == 1:
        return out
    return SplitSums(out, x.dtype) if keep_splits and split_sums_on() else sum_splits(out, x.dtype)


def gemv_glu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
             config: Tiles | None = None) -> torch.Tensor:
    """silu(x gate^T) * (x up^T) for weight = [gate; up] ([2N, K], scaled as in `gemv`):
    the SwiGLU MLP's middle in the GEMV's own launch, [M, N] in x's dtype. K is not sliced
    (SiLU of partial sums is not the SiLU of their sum)."""
    m, k = x.shape
    n = weight.shape[0] // 2
    config = fit_scale_groups(config or glu_config(m, n, k, weight.element_size()), k, weight_scale)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, weight_scale, out, n, k, 1, config, glu=True)
    return out


def scale_group(k: int, weight_scale: torch.Tensor | None) -> int:
    """The K-width of one weight scale (block-scaled float8 weights, [N, G] scales), or 0 for
    one scale per row (or none). A width the kernel cannot step through (not a power of two
    of at least 16) is -1: such weights take the dequantizing path (fp8.fp8_linear)."""
    if weight_scale is None or weight_scale.shape[1] == 1:
        return 0
    groups = weight_scale.shape[1]
    width = k // groups
    return width if width * groups == k and width >= 16 and width & (width - 1) == 0 else -1


def fit_scale_groups(config: Tiles, k: int, weight_scale: torch.Tensor | None) -> Tiles:
    """Tiles whose K steps stay inside one scale group (block-scaled weights)."""
    width = scale_group(k, weight_scale)
    if width > 0 and config.block_k > width:
        return dataclasses.replace(config, block_k=width)
    return config


def glu_config(rows: int, n: int, k: int, weight_bytes: int) -> Tiles:
    """`gemv_glu`'s tiles: a program reads block_n rows of the gate and as many of up, the
    whole of K. H200 sweep (scripts/bench_layer_kernels.py --glu, Llama-3-8B gate_up, us,
    two launches -> one): float8 x1 35.5 -> 34.3, x4 43.1 -> 43.0, x16 42.9 -> 42.1; bf16 x1
    59.4 -> 59.0 at block_n 8 (the engine keeps bf16 on two launches: linear.py)."""
    if weight_bytes == 2:
        return Tiles(block_n=8, block_k=128, num_stages=3)
    if rows == 1:
        return Tiles(block_n=16, block_k=128, num_stages=4)
    return Tiles(block_n=16, block_k=256, num_stages=3)


def _launch(x, weight, weight_scale, out, n: int, k_per_split: int, split_k: int, config: Tiles,
            glu: bool) -> None:
    m, k = x.shape
    # tl.dot wants at least 16 rows; one row multiplies on the CUDA cores.
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    _gemv_kernel[(triton.cdiv(n, config.block_n), split_k)](
        x, weight, weight if weight_scale is None else weight_scale, out, m, n, k,
        k_per_split, x.stride(0), weight.stride(0), out.stride(-2), ROW_DOT_SCALE,
        0 if weight_scale is None else weight_scale.stride(0),
        # float32 activations get float32 products, not TF32's 10-bit mantissa
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k,
        HAS_SCALE=weight_scale is not None, num_warps=config.num_warps,
        # f16 products for bf16/fp16 activations only: float32 ones keep float32 products
        ROW_DOT=config.row_dot and block_m == 1 and weight.element_size() == 1
        and x.dtype != torch.float32,
        GLU=glu, SCALE_GROUP=max(0, scale_group(k, weight_scale)),
        num_stages=config.num_stages, **pdl_launch(x.device))


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 config: Tiles | None = None, keep_splits: bool = False) -> torch.Tensor | SplitSums:
    """x [M, K] (bf16/fp16/fp32), weight float8 [N, K], weight_scale float32 [N, 1] (or
    [N, G]: block scales, G groups of a power-of-two width along K) -> [M, N] in x's dtype
    (or, with `keep_splits`, possibly its K-slice partial sums). M is small (decode): the
    whole batch is one row block."""
    return gemv(x, weight, weight_scale, config, keep_splits)
