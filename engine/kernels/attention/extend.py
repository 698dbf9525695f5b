"""Triton extend/prefill kernel: ragged new tokens over a cached prefix, causal.

Conventions, specialization and the FP8/window switches: triton_common.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.attention.common import (f16_operand, in_window, kv_decode, load_kv,
                                             softmax_step)
from engine.kernels.launch import pdl_prologue

# ----------------------------------------------------------------------------------------
# Extend / prefill: grid (Hq, B, num_m_blocks). One program = BLOCK_M new tokens of one
# request for one query head. It first sweeps the cached prefix (slots through
# req_to_token, no causal mask), then the request's new tokens read straight from the
# k/v inputs (contiguous rows): blocks wholly before the tile's first query need no mask,
# only the diagonal blocks are masked causally. Online softmax in fp32, base 2.
# The m-block axis is walked from the last block down so the longest programs start first.
# ----------------------------------------------------------------------------------------
# num_m_blocks only bounds the grid walk (== 1 for prompts up to BLOCK_M tokens, else a
# multiple of 16 or not); the per-request arrays are step metadata.
# skip_decoders (run-time): requests with one new token are the decode kernel's (a mixed
# step in a captured extend graph, triton_decode.py's by_qo).
@triton.jit(do_not_specialize=["num_m_blocks", "skip_decoders"],
            do_not_specialize_on_alignment=["ReqRows", "SeqLens", "ExtendLens", "QoIndptr"])
def extend_kernel(Q, K, V, KC, VC, Out, ReqToToken, ReqRows, SeqLens, ExtendLens, QoIndptr,
                  sm_scale_log2, num_m_blocks, skip_decoders,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_kct, stride_kch, stride_vct, stride_vch,
                  stride_rt, stride_ot, stride_oh,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
                  KV_FP8: tl.constexpr = False, KV_SCALE: tl.constexpr = 1.0,
                  WINDOW: tl.constexpr = 0,
                  PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    h = tl.program_id(0)
    b = tl.program_id(1)
    mblk = num_m_blocks - 1 - tl.program_id(2)
    ext = tl.load(ExtendLens + b)
    if skip_decoders != 0:
        ext = tl.where(ext == 1, 0, ext)
    if mblk * BLOCK_M < ext:
        seq_len = tl.load(SeqLens + b)
        prefix = seq_len - ext
        q0 = tl.load(QoIndptr + b).to(tl.int64)
        row = tl.load(ReqRows + b).to(tl.int64)
        kvh = h // GROUP

        m_offs = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m_offs < ext
        d = tl.arange(0, BLOCK_D)
        nd = tl.arange(0, BLOCK_N)
        if BLOCK_D == HEAD_DIM:
            dmask = d < BLOCK_D
        else:
            dmask = d < HEAD_DIM

        q = tl.load(Q + (q0 + m_offs)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qpos = prefix + m_offs
        if WINDOW > 0:
            # no row of the tile sees keys before `lo`: both sweeps start at its block
            lo = tl.maximum(prefix + mblk * BLOCK_M - WINDOW + 1, 0)
            prefix_lo = (lo // BLOCK_N) * BLOCK_N
            new_lo = (tl.maximum(lo - prefix, 0) // BLOCK_N) * BLOCK_N
        else:
            prefix_lo = 0
            new_lo = 0

        # 1) cached prefix, through req_to_token: full blocks, then the ragged last one
        q_pool = f16_operand(q, KV_FP8, F32_DOT)  # the query as dots over pool K/V take it
        tok = ReqToToken + row * stride_rt
        kc_base = KC + kvh * stride_kch
        vc_base = VC + kvh * stride_vch
        prefix_full = (prefix // BLOCK_N) * BLOCK_N
        for n in range(prefix_lo, prefix_full, BLOCK_N):
            slots = tl.load(tok + n + nd).to(tl.int64)
            k, v = load_kv(kc_base + slots[:, None] * stride_kct + d[None, :],
                            vc_base + slots[:, None] * stride_vct + d[None, :],
                            dmask, BLOCK_D, HEAD_DIM)
            k = kv_decode(k, KV_FP8, KV_SCALE)
            v = kv_decode(v, KV_FP8, KV_SCALE)
            if WINDOW > 0:
                m_i, l_i, acc = softmax_step(q_pool, k, v, m_i, l_i, acc, sm_scale_log2,
                                              in_window(n + nd, qpos, WINDOW), True, F32_DOT,
                                              True)
            else:
                m_i, l_i, acc = softmax_step(q_pool, k, v, m_i, l_i, acc, sm_scale_log2, 0,
                                              False, F32_DOT)
        if prefix_full < prefix:
            offs = prefix_full + nd
            nmask = offs < prefix
            slots = tl.load(tok + offs, mask=nmask, other=0).to(tl.int64)  # 0: padding slot
            k = tl.load(kc_base + slots[:, None] * stride_kct + d[None, :],
                        mask=dmask[None, :], other=0.0)
            v = tl.load(vc_base + slots[:, None] * stride_vct + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            k = kv_decode(k, KV_FP8, KV_SCALE)
            v = kv_decode(v, KV_FP8, KV_SCALE)
            mask = nmask[None, :]
            if WINDOW > 0:
                mask = mask & in_window(offs, qpos, WINDOW)
            m_i, l_i, acc = softmax_step(q_pool, k, v, m_i, l_i, acc, sm_scale_log2,
                                          mask, True, F32_DOT, WINDOW > 0)

        # 2) the new tokens, causal: new token j sees new tokens 0..j (with an fp8 pool the
        # store kernel has rounded them in place to what the pool holds)
        k_base = K + q0 * stride_kt + kvh * stride_kh
        v_base = V + q0 * stride_vt + kvh * stride_vh
        # keys below the tile's first query row are visible to every row (and < ext)
        full_end = ((mblk * BLOCK_M) // BLOCK_N) * BLOCK_N
        for n in range(new_lo, full_end, BLOCK_N):
            offs = n + nd
            k, v = load_kv(k_base + offs[:, None] * stride_kt + d[None, :],
                            v_base + offs[:, None] * stride_vt + d[None, :],
                            dmask, BLOCK_D, HEAD_DIM)
            if WINDOW > 0:
                m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2,
                                              in_window(prefix + offs, qpos, WINDOW), True,
                                              F32_DOT, True)
            else:
                m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, 0,
                                              False, F32_DOT)
        end = tl.minimum(ext, (mblk + 1) * BLOCK_M)
        for n in range(full_end, end, BLOCK_N):
            offs = n + nd
            nmask = offs < ext
            k = tl.load(k_base + offs[:, None] * stride_kt + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            v = tl.load(v_base + offs[:, None] * stride_vt + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            causal = (offs[None, :] <= m_offs[:, None]) & nmask[None, :]
            if WINDOW > 0:
                causal = causal & in_window(prefix + offs, qpos, WINDOW)
            m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, causal,
                                          True, F32_DOT, WINDOW > 0)

        out = acc / l_i[:, None]
        tl.store(Out + (q0 + m_offs)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
