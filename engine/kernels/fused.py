"""Triton kernels that fuse the decoder layer's small element-wise ops.

At batch 1 a Llama layer is two GEMMs of real work around dozens of tiny kernels (the
residual add and RMSNorm statistics, RoPE's gathers and halves, SiLU and the multiply);
even inside a CUDA graph each costs a few microseconds. One kernel per op here, each
rounding where the torch reference path rounds (to the model dtype after the residual
add, after the normalisation and after SiLU), so both paths agree to within an ulp.

Imported only when a layer runs on a GPU with fused kernels on (`set_fused_kernels`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.inline import add_split_sums, silu_mul, store_quantized_row
from engine.kernels.launch import pdl_launch, pdl_prologue
from engine.kernels.split_sums import SplitSums
from engine.kernels.fp8_format import FP8_MAX, MIN_SCALE, Fp8Rows, empty_quantized


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, ResOut, Scale, stride_x, stride_r, stride_o, stride_ro, n_cols,
                    eps, stride_split, fp8_max, min_scale, HAS_RESIDUAL: tl.constexpr,
                    BLOCK: tl.constexpr, SPLITS: tl.constexpr = 0, QUANTIZE: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """SPLITS > 0: X is a GEMV's float32 K-slice partial sums, added here. QUANTIZE: Out is
    float8 with a scale per row at Scale (an FP8 linear's input)."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # the model dtype (QUANTIZE takes plain rows: X holds no float32 partial sums)
    dtype = X.dtype.element_ty if QUANTIZE else Out.dtype.element_ty
    x = add_split_sums(X + row * stride_x + cols, mask, stride_split, SPLITS, dtype)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    out = (w * y).to(x.dtype)
    if QUANTIZE:
        store_quantized_row(out, mask, Out + row * stride_o + cols, Scale + row, fp8_max,
                            min_scale)
    else:
        tl.store(Out + row * stride_o + cols, out, mask=mask)


def rmsnorm(x: torch.Tensor | SplitSums, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, quantize: bool = False):
    """norm(x) or, with a residual, (norm(x + residual), x + residual); x is [..., N], or
    a GEMV's partial sums [rows, N] (then both outputs are [rows, N]). `quantize` (plain x
    only): norm(x) comes back as `Fp8Rows` [rows, N] for an FP8 linear."""
    x2, splits, stride_split = _rows_of(x)
    shape = x2.shape if splits else x.shape
    rows, n = x2.shape
    out = (empty_quantized(rows, n, x.dtype, x2.device) if quantize
           else torch.empty((rows, n), dtype=x.dtype, device=x2.device))
    out_rows, scale = (out.q, out.scale) if quantize else (out, out)
    block = triton.next_power_of_2(n)
    warps = min(16, max(1, block // 256))
    common = dict(BLOCK=block, SPLITS=splits, QUANTIZE=quantize, num_warps=warps,
                  **pdl_launch(x2.device))
    if residual is None:
        _rmsnorm_kernel[(rows,)](x2, x2, weight, out_rows, x2, scale, x2.stride(0), 0,
                                 out_rows.stride(0), 0, n, eps, stride_split, FP8_MAX, MIN_SCALE,
                                 HAS_RESIDUAL=False, **common)
        return out if quantize else out.view(shape)
    r2 = residual.reshape(-1, n)
    res_out = torch.empty((rows, n), dtype=x.dtype, device=x2.device)
    _rmsnorm_kernel[(rows,)](x2, r2, weight, out_rows, res_out, scale, x2.stride(0), r2.stride(0),
                             out_rows.stride(0), res_out.stride(0), n, eps, stride_split, FP8_MAX,
                             MIN_SCALE, HAS_RESIDUAL=True, **common)
    return (out if quantize else out.view(shape)), res_out.view(shape)


def _rows_of(x: torch.Tensor | SplitSums) -> tuple[torch.Tensor, int, int]:
    """(rows [T, N] to load from: split 0 of partial sums or x itself, number of splits (0:
    x is plain), elements between splits)."""
    if isinstance(x, SplitSums):
        return x.parts[0], x.splits, x.parts.stride(0)
    return x.reshape(-1, x.shape[-1]), 0, 0


@triton.jit
def _silu_and_mul_kernel(X, Out, Scale, stride_x, stride_o, d, stride_split, fp8_max, min_scale,
                         BLOCK: tl.constexpr, SPLITS: tl.constexpr = 0,
                         QUANTIZE: tl.constexpr = False, PDL: tl.constexpr = False):
    """SPLITS > 0: X is a GEMV's float32 K-slice partial sums, added here. QUANTIZE: one
    program holds the whole row (BLOCK >= d) and Out is float8 with a scale per row."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    # the model dtype (QUANTIZE takes plain rows: X holds no float32 partial sums)
    dtype = X.dtype.element_ty if QUANTIZE else Out.dtype.element_ty
    gate = add_split_sums(X + row * stride_x + cols, mask, stride_split, SPLITS, dtype)
    up = add_split_sums(X + row * stride_x + d + cols, mask, stride_split, SPLITS, dtype)
    if QUANTIZE:
        store_quantized_row(silu_mul(gate, up), mask, Out + row * stride_o + cols, Scale + row,
                            fp8_max, min_scale)
    else:
        tl.store(Out + row * stride_o + cols, silu_mul(gate, up), mask=mask)


# Widest row SiLU-and-mul quantizes in one program (32 warps: 16 values a thread). Llama-3-8B's
# 14,336 on the H200: 22.6 / 67 / 233 us at 479 / 2,048 / 8,192 rows (16 warps 24.0 / 69 / 240;
# two passes over rows from L2, best of 48 configs, 28 / 78 / 270); SiLU-and-mul, then the
# quantizer: 50-58 / 88-111 / 309.
QUANTIZE_MAX_WIDTH = 16384


def silu_and_mul(x: torch.Tensor | SplitSums, quantize: bool = False) -> torch.Tensor | Fp8Rows:
    """[T, 2d] (or a GEMV's partial sums of it) -> silu(x[:, :d]) * x[:, d:]. `quantize`
    (plain [T, 2d] x): as `Fp8Rows` for an FP8 linear, when d <= QUANTIZE_MAX_WIDTH (wider
    rows come back unquantized, and the linear quantizes them)."""
    x2, splits, stride_split = _rows_of(x)
    rows, d = x2.shape[0], x2.shape[1] // 2
    if quantize and d <= QUANTIZE_MAX_WIDTH:
        out = empty_quantized(rows, d, x.dtype, x2.device)
        block = triton.next_power_of_2(d)
        _silu_and_mul_kernel[(rows, 1)](
            x2, out.q, out.scale, x2.stride(0), out.q.stride(0), d, 0, FP8_MAX, MIN_SCALE,
            BLOCK=block, QUANTIZE=True, num_warps=min(32, max(4, block // 512)),
            **pdl_launch(x2.device))
        return out
    out = torch.empty((rows, d), dtype=x.dtype, device=x2.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x2, out, x2, x2.stride(0), out.stride(0), d, stride_split, FP8_MAX, MIN_SCALE,
        BLOCK=block, SPLITS=splits, num_warps=4, **pdl_launch(x2.device))
    return out if splits else out.view(*x.shape[:-1], d)


# Pos is a slice of the step's flat int64 upload, so its 16-byte alignment varies with the
# other fields' lengths; it is read one scalar per program, so the hint buys nothing and
# would only compile a second binary on a fresh replica (see attention/triton_common.py).
@triton.jit(do_not_specialize_on_alignment=["Pos"])
def _rope_kernel(Q, K, V, Pos, Cache, QOut, KOut, VOut, QNormW, KNormW, eps,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                 stride_qot, stride_qoh, stride_kot, stride_koh, stride_vot, stride_voh,
                 stride_split, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                 HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 SPLITS: tl.constexpr = 0, PDL: tl.constexpr = False):
    """SPLITS > 0: Q, K and V point into a qkv GEMV's float32 K-slice partial sums, added
    here, and V's sums are written to VOut too."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    dtype = QOut.dtype.element_ty
    pos = tl.load(Pos + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    cos = tl.load(Cache + pos * stride_ct + j, mask=jmask, other=0.0)[None, :]
    sin = tl.load(Cache + pos * stride_ct + HALF + j, mask=jmask, other=0.0)[None, :]
    # one block of BLOCK_H heads (q heads, then k heads) per program
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_q = heads < HQ
    kh = heads - HQ
    hmask = heads < HQ + HKV
    m = hmask[:, None] & jmask[None, :]
    qm = m & is_q[:, None]
    km = m & (~is_q)[:, None]
    src_q = Q + t * stride_qt + heads[:, None] * stride_qh + j[None, :]
    src_k = K + t * stride_kt + kh[:, None] * stride_kh + j[None, :]
    x1 = (add_split_sums(src_q, qm, stride_split, SPLITS, dtype)
          + add_split_sums(src_k, km, stride_split, SPLITS, dtype))
    x2 = (add_split_sums(src_q + HALF, qm, stride_split, SPLITS, dtype)
          + add_split_sums(src_k + HALF, km, stride_split, SPLITS, dtype))
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm first (Qwen3), rounded where RMSNorm's torch path rounds
        rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.where(is_q[:, None], tl.load(QNormW + j, mask=jmask, other=0.0)[None, :],
                      tl.load(KNormW + j, mask=jmask, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(is_q[:, None], tl.load(QNormW + HALF + j, mask=jmask, other=0.0)[None, :],
                      tl.load(KNormW + HALF + j, mask=jmask, other=0.0)[None, :]).to(tl.float32)
        a = (w1 * (a * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        b = (w2 * (b * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    o1 = (a * cos - b * sin).to(x1.dtype)
    o2 = (b * cos + a * sin).to(x1.dtype)
    dst_q = QOut + t * stride_qot + heads[:, None] * stride_qoh + j[None, :]
    dst_k = KOut + t * stride_kot + kh[:, None] * stride_koh + j[None, :]
    tl.store(dst_q, o1, mask=qm)
    tl.store(dst_q + HALF, o2, mask=qm)
    tl.store(dst_k, o1, mask=km)
    tl.store(dst_k + HALF, o2, mask=km)
    if SPLITS > 0:  # v heads by the same blocks: v's sums
        m = (heads < HKV)[:, None] & jmask[None, :]
        src_v = V + t * stride_vt + heads[:, None] * stride_vh + j[None, :]
        dst_v = VOut + t * stride_vot + heads[:, None] * stride_voh + j[None, :]
        tl.store(dst_v, add_split_sums(src_v, m, stride_split, SPLITS, dtype), mask=m)
        tl.store(dst_v + HALF, add_split_sums(src_v + HALF, m, stride_split, SPLITS, dtype), mask=m)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
         qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (any row and head strides, unit last stride), rotated by
    full-width "rotate half" RoPE into new contiguous tensors. `qk_norm` = (q weight [D],
    k weight [D], eps): each head RMS-normalised first, in the same launch (Qwen3's q/k norms:
    three kernels and two copies of q and k before)."""
    q_out, k_out, _ = _rope(positions, q, k, None, cos_sin_cache, qk_norm, 0, 0)
    return q_out, k_out


def rope_split_sums(positions: torch.Tensor, qkv: SplitSums, heads: tuple[int, int, int],
                    cos_sin_cache: torch.Tensor,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope` on q and k of a qkv projection left as partial sums ([T, (Hq + 2 Hkv) D],
    `heads` = (Hq, Hkv, D)), which the launch adds up; v comes back summed too."""
    hq, hkv, d = heads
    first = qkv.parts[0]
    t = first.shape[0]
    q = first[:, :hq * d].view(t, hq, d)
    k = first[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = first[:, (hq + hkv) * d:].view(t, hkv, d)
    return _rope(positions, q, k, v, cos_sin_cache, qk_norm, qkv.splits, qkv.parts.stride(0),
                 qkv.dtype)


def _rope(positions, q, k, v, cos_sin_cache, qk_norm, splits: int, stride_split: int,
          dtype: torch.dtype | None = None):
    t, hq, d = q.shape
    hkv = k.shape[1]
    dtype = dtype or q.dtype
    q_out = torch.empty((t, hq, d), dtype=dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=dtype, device=k.device)
    v_out = torch.empty((t, hkv, d), dtype=dtype, device=k.device) if splits else None
    if t == 0:
        return q_out, k_out, v_out
    half = d // 2
    # Blocks of 4 heads while a few tokens would leave most multiprocessors idle (batch-1
    # decode on the H200: 4.39 ms a step, 4.48 with one program per token, in two calls);
    # 16 for prefill. With the per-head RMSNorm, 4 always: its sum over a head's row is
    # laid out by the tile's shape, and one shape for every launch keeps a token's q and k
    # bit for bit the same in a prefill and a decode (prefix reuse is exact).
    wide = t >= 64 and qk_norm is None
    block_h = min(16 if wide else 4, triton.next_power_of_2(hq + hkv))
    q_weight, k_weight, eps = qk_norm or (q, k, 0.0)  # unread without the norm
    v_in, v_dst = (v, v_out) if splits else (k, k_out)  # unread without splits
    _rope_kernel[(t, triton.cdiv(hq + hkv, block_h))](
        q, k, v_in, positions, cos_sin_cache, q_out, k_out, v_dst, q_weight, k_weight, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_in.stride(0), v_in.stride(1),
        cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0),
        k_out.stride(1), v_dst.stride(0), v_dst.stride(1), stride_split,
        HQ=hq, HKV=hkv, HALF=half, HAS_NORM=qk_norm is not None, BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half), SPLITS=splits, num_warps=4,
        **pdl_launch(q.device))
    return q_out, k_out, v_out
