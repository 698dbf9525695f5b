"""Segmented LoRA matmul (S-LoRA / Punica's SGMV): one step's tokens, cut into segments
(a request's new tokens), each segment under its own adapter slot, or none (-1: the base).

Two launches per adapted linear: shrink, x [T, in] @ A[slot]^T -> xa [T, parts * R], then
expand, y[:, part cols] += xa[:, part's R] @ B[slot]^T. A slot's rank bounds the work (the
pool pads every adapter to R): shrink skips rank tiles past it, expand loops K up to it.
Sizes that change from step to step (segments, the longest segment) shape only the grid,
so a CUDA graph captured for one batch size replays for any adapters in its slots.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_launch, pdl_prologue

BLOCK_M = 16
BLOCK_R = 16  # = the pool's rank alignment (engine/lora/pool.py)


@triton.jit
def _segment(SegIndptr, SegSlots, BLOCK_M: tl.constexpr):
    """This program's segment: its slot (-1: the base), first row and end row."""
    seg = tl.program_id(0)
    slot = tl.load(SegSlots + seg).to(tl.int64)
    m0 = tl.load(SegIndptr + seg) + tl.program_id(1) * BLOCK_M
    return slot, m0, tl.load(SegIndptr + seg + 1)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _shrink_kernel(X, A, Out, SegIndptr, SegSlots, Ranks, k_dim, r_pool, stride_x, stride_as,
                   stride_ar, stride_o, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    slot, m0, end = _segment(SegIndptr, SegSlots, BLOCK_M)
    r0 = tl.program_id(2) * BLOCK_R
    if slot >= 0 and m0 < end:
        if r0 % r_pool < tl.load(Ranks + slot):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_m = offs_m < end
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, k_dim, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                mk = kk < k_dim
                x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_x + kk[None, :],
                            mask=mask_m[:, None] & mk[None, :], other=0.0)
                a = tl.load(A + slot * stride_as + offs_r[None, :] * stride_ar + kk[:, None],
                            mask=mk[:, None], other=0.0)
                acc += _dot(x, a, F32_DOT)
            tl.store(Out + offs_m[:, None].to(tl.int64) * stride_o + offs_r[None, :],
                     acc.to(Out.dtype.element_ty), mask=mask_m[:, None])


@triton.jit
def _expand_kernel(XA, B, Y, SegIndptr, SegSlots, Ranks, n_dim, r_pool, bound1, bound2, stride_xa,
                   stride_bs, stride_bn, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    slot, m0, end = _segment(SegIndptr, SegSlots, BLOCK_M)
    n0 = tl.program_id(2) * BLOCK_N
    if slot >= 0 and m0 < end:
        rank = tl.load(Ranks + slot)
        # the fused linear's part this column tile belongs to (tiles never straddle parts)
        part = (n0 >= bound1).to(tl.int32) + (n0 >= bound2).to(tl.int32)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_m = offs_m < end
        mask_n = offs_n < n_dim
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, rank, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            mk = kk < rank
            xa = tl.load(XA + offs_m[:, None].to(tl.int64) * stride_xa + (part * r_pool + kk)[None, :],
                         mask=mask_m[:, None] & mk[None, :], other=0.0)
            b = tl.load(B + slot * stride_bs + offs_n[None, :] * stride_bn + kk[:, None],
                        mask=mk[:, None] & mask_n[None, :], other=0.0)
            acc += _dot(xa, b, F32_DOT)
        ptrs = Y + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=mask)


def column_tile(bounds: list[int]) -> int | None:
    """The expand kernel's column tile: the largest of 64, 32, 16 that divides every part
    boundary (None: the torch path must serve this linear)."""
    for tile in (64, 32, 16):
        if all(b % tile == 0 for b in bounds):
            return tile
    return None


def lora_sgmv(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              ranks: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
              num_segments: int, max_seg_len: int, bounds: list[int], tile_n: int) -> None:
    """y += each segment's LoRA delta, in place. x [T, in], y [T, out], a [slots, P*R, in],
    b [slots, out, R], ranks [slots]; segment i is rows [seg_indptr[i], seg_indptr[i+1])
    under slot seg_slots[i] (-1: untouched)."""
    if num_segments == 0 or max_seg_len == 0:
        return
    x = x.contiguous()
    t, k = x.shape
    pr, r = a.shape[1], b.shape[2]
    n = b.shape[1]
    xa = torch.empty(t, pr, dtype=x.dtype, device=x.device)
    # fp32 operands in IEEE precision for fp32 models and under the CPU interpreter (whose
    # bf16 dot is wrong); bf16/fp16 dots with fp32 accumulation otherwise
    f32_dot = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    m_tiles = triton.cdiv(max_seg_len, BLOCK_M)
    _shrink_kernel[(num_segments, m_tiles, pr // BLOCK_R)](
        x, a, xa, seg_indptr, seg_slots, ranks, k, r, x.stride(0), a.stride(0), a.stride(1),
        xa.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=64, F32_DOT=f32_dot,
        **pdl_launch(x.device))
    big = n + 1  # a boundary past the last column: no part there
    b1 = bounds[0] if bounds else big
    b2 = bounds[1] if len(bounds) > 1 else big
    _expand_kernel[(num_segments, m_tiles, triton.cdiv(n, tile_n))](
        xa, b, y, seg_indptr, seg_slots, ranks, n, r, b1, b2, xa.stride(0), b.stride(0),
        b.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=tile_n, BLOCK_K=BLOCK_R, F32_DOT=f32_dot,
        **pdl_launch(x.device))
