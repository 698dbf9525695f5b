"""Triton attention over packed sequences with no KV cache: the pooling tasks' one forward.

Q, K and V hold B sequences back to back ([T, H, D] rows, `cu_seqlens` [B + 1] their
bounds); each query attends only within its own sequence, to every key (encoders) or to
the keys up to itself (`CAUSAL`: decoders used as embedders). Nothing is padded, so a
packed batch of short inputs costs its real tokens only, and every launch is the same
kernel whatever the lengths (no per-shape backend choice, no mask tensor).
Conventions (base-2 softmax, BLOCK_D, F32_DOT): engine/kernels/attention/common.py.

Grid (B, Hq, m-blocks): one program = BLOCK_M queries of one sequence for one head; the
m-block axis walks from the last block down so the longest programs start first.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.attention.common import load_kv, softmax_step
from engine.kernels.launch import pdl_launch, pdl_prologue

_LOG2E = 1.4426950408889634
BLOCK_M = 64
BLOCK_N = 64


@triton.jit(do_not_specialize=["num_m_blocks"], do_not_specialize_on_alignment=["CuSeqlens"])
def varlen_attention_kernel(Q, K, V, Out, CuSeqlens, sm_scale_log2, num_m_blocks,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_ot, stride_oh,
                            GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            F32_DOT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = num_m_blocks - 1 - tl.program_id(2)
    first = tl.load(CuSeqlens + b)
    n = tl.load(CuSeqlens + b + 1) - first
    if mblk * BLOCK_M < n:
        start = first.to(tl.int64)
        kvh = h // GROUP
        m_offs = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m_offs < n
        d = tl.arange(0, BLOCK_D)
        nd = tl.arange(0, BLOCK_N)
        dmask = d < HEAD_DIM
        q = tl.load(Q + (start + m_offs)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + start * stride_kt + kvh * stride_kh
        v_base = V + start * stride_vt + kvh * stride_vh
        if CAUSAL:  # blocks wholly below the tile's first query are seen by every row
            full_end = ((mblk * BLOCK_M) // BLOCK_N) * BLOCK_N
            end = tl.minimum(n, (mblk + 1) * BLOCK_M)
        else:
            full_end = (n // BLOCK_N) * BLOCK_N
            end = n
        for s in range(0, full_end, BLOCK_N):
            offs = s + nd
            k, v = load_kv(k_base + offs[:, None] * stride_kt + d[None, :],
                           v_base + offs[:, None] * stride_vt + d[None, :],
                           dmask, BLOCK_D, HEAD_DIM)
            m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, 0, False,
                                         F32_DOT)
        for s in range(full_end, end, BLOCK_N):  # the ragged last block, or the diagonal
            offs = s + nd
            nmask = offs < n
            k = tl.load(k_base + offs[:, None] * stride_kt + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            v = tl.load(v_base + offs[:, None] * stride_vt + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            mask = nmask[None, :]
            if CAUSAL:
                mask = mask & (offs[None, :] <= m_offs[:, None])
            m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, mask, True,
                                         F32_DOT)
        out = acc / l_i[:, None]
        tl.store(Out + (start + m_offs)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def triton_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor, max_len: int, causal: bool,
                            scale: float) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] (rows may be strided views of a fused qkv; the
    last dim contiguous), `cu_seqlens` [B + 1] int32 on q's device, `max_len` the longest
    sequence (a host int: it sizes the grid, so nothing syncs) -> [T, Hq, D]."""
    t, hq, d = q.shape
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    num_m_blocks = triton.cdiv(max_len, BLOCK_M)
    f32_dot = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    varlen_attention_kernel[(cu_seqlens.numel() - 1, hq, num_m_blocks)](
        q, k, v, out, cu_seqlens, scale * _LOG2E, num_m_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=hq // k.shape[1], CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), F32_DOT=f32_dot,
        num_warps=4, num_stages=2, **pdl_launch(q.device))
    return out
