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

from engine.layers.pdl import pdl_launch, pdl_prologue


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * y).to(x.dtype), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None):
    """norm(x) or, with a residual, (norm(x + residual), x + residual); x is [..., N]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = min(16, max(1, block // 256))
    if residual is None:
        _rmsnorm_kernel[(rows,)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0,
                                 n, eps, HAS_RESIDUAL=False, BLOCK=block, num_warps=warps,
                                 **pdl_launch(x.device))
        return out.view(shape)
    r2 = residual.reshape(-1, n)
    res_out = torch.empty_like(out)
    _rmsnorm_kernel[(rows,)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0),
                             out.stride(0), res_out.stride(0), n, eps, HAS_RESIDUAL=True,
                             BLOCK=block, num_warps=warps, **pdl_launch(x.device))
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2d] -> silu(x[:, :d]) * x[:, d:]."""
    x2 = x.reshape(-1, x.shape[-1])
    rows, d = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d,
                                                          BLOCK=block, num_warps=4,
                                                          **pdl_launch(x.device))
    return out.view(*x.shape[:-1], d)


# Pos is a slice of the step's flat int64 upload, so its 16-byte alignment varies with the
# other fields' lengths; it is read one scalar per program, so the hint buys nothing and
# would only compile a second binary on a fresh replica (see attention/triton_common.py).
@triton.jit(do_not_specialize_on_alignment=["Pos"])
def _rope_kernel(Q, K, Pos, Cache, QOut, KOut, QNormW, KNormW, eps,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
                 stride_qot, stride_qoh, stride_kot, stride_koh,
                 HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    cos = tl.load(Cache + pos * stride_ct + j, mask=jmask, other=0.0)[None, :]
    sin = tl.load(Cache + pos * stride_ct + HALF + j, mask=jmask, other=0.0)[None, :]
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, HQ + HKV, BLOCK_H):
        heads = h0 + h
        is_q = heads < HQ
        kh = heads - HQ
        hmask = heads < HQ + HKV
        m = hmask[:, None] & jmask[None, :]
        qm = m & is_q[:, None]
        km = m & (~is_q)[:, None]
        src_q = Q + t * stride_qt + heads[:, None] * stride_qh + j[None, :]
        src_k = K + t * stride_kt + kh[:, None] * stride_kh + j[None, :]
        x1 = tl.load(src_q, mask=qm, other=0.0) + tl.load(src_k, mask=km, other=0.0)
        x2 = tl.load(src_q + HALF, mask=qm, other=0.0) + tl.load(src_k + HALF, mask=km, other=0.0)
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


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
         qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (any row and head strides, unit last stride), rotated by
    full-width "rotate half" RoPE into new contiguous tensors. `qk_norm` = (q weight [D],
    k weight [D], eps): each head RMS-normalised first, in the same launch (Qwen3's q/k norms:
    three kernels and two copies of q and k before)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = d // 2
    block_h = min(16, triton.next_power_of_2(hq + hkv))
    q_weight, k_weight, eps = qk_norm or (q, k, 0.0)  # unread without the norm
    _rope_kernel[(t,)](q, k, positions, cos_sin_cache, q_out, k_out, q_weight, k_weight, eps,
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
                       q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                       HQ=hq, HKV=hkv, HALF=half, HAS_NORM=qk_norm is not None, BLOCK_H=block_h,
                       BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
                       **pdl_launch(q.device))
    return q_out, k_out
