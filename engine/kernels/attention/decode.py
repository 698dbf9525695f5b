"""Triton decode kernels: split-KV decode (partials + reduce) and radix-grouped decode's
shared-prefix kernel, with its merge into each request's suffix.

Conventions, specialization and the FP8/window switches: triton_common.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.attention.common import attend_slots, store_encoded
from engine.kernels.launch import pdl_prologue

# ----------------------------------------------------------------------------------------
# Decode, stage 1: grid (Hkv, B, num_splits). One program = one request, one KV head, one
# contiguous chunk of the request's tokens; it serves all GROUP query heads of that KV
# head at once (q is a [BLOCK_H, D] tile, BLOCK_H >= 16 so tl.dot applies), so every K/V
# row is loaded once per KV head.
#
# Chunking is computed on the device from seq_len, so the grid (and a captured CUDA graph)
# only depends on num_splits: chunk = roundup(cdiv(seq_len, num_splits), BLOCK_N); splits
# past the end do nothing. With DIRECT (num_splits == 1) the program writes the final
# output; otherwise it writes a normalised partial output and its log2-sum-exp.
# ----------------------------------------------------------------------------------------
# With `by_qo` (a mixed step in a captured extend graph, where the host cannot know which
# requests decode) the grid covers every request: request b's query and output row is
# QoIndptr[b], and requests without exactly one new token are left to the extend kernel.
#
# With STORE_KV (a pure decode step) the kernel also stores the new token's K/V (request b's
# row b of K and V) in the pool, which saves the store kernel's launch: the one program per
# (KV head, request) whose split holds the last position stores its head's K/V there before
# it attends (see _store_new_token).
#
# num_splits and the log-sum-exp strides (multiples of it) vary with batch size and
# sequence length in eager decode; ReqRows/SeqLens/PfxLens/Ctrl/QoIndptr/ExtendLens are
# step metadata; by_qo is a run-time switch, not a specialization.
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh", "by_qo"],
            do_not_specialize_on_alignment=["ReqRows", "SeqLens", "PfxLens", "Ctrl", "QoIndptr",
                                            "ExtendLens"])
def decode_partial_kernel(Q, K, V, KC, VC, ReqToToken, ReqRows, SeqLens, Out, MidO, MidLse,
                          PfxLens, PfxO, PfxLse, Ctrl, QoIndptr, ExtendLens,
                          sm_scale_log2, num_splits, by_qo,
                          stride_qt, stride_qh,
                          stride_knt, stride_knh, stride_vnt, stride_vnh,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_rt,
                          stride_ot, stride_oh,
                          stride_mb, stride_mh, stride_ms,
                          stride_lb, stride_lh,
                          stride_pb, stride_ph, stride_pp,
                          stride_plb, stride_plh,
                          GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          DIRECT: tl.constexpr, F32_DOT: tl.constexpr,
                          HAS_PREFIX: tl.constexpr = False, PFX_BLOCK_N: tl.constexpr = 64,
                          PMAX: tl.constexpr = 4, KV_FP8: tl.constexpr = False,
                          KV_SCALE: tl.constexpr = 1.0, WINDOW: tl.constexpr = 0,
                          STORE_KV: tl.constexpr = False, FP8_SW_ROUND: tl.constexpr = False,
                          PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    kvh = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    qrow = b
    if by_qo != 0:
        qrow = tl.load(QoIndptr + b).to(tl.int64)
        seq_len = tl.where(tl.load(ExtendLens + b) == 1, seq_len, 0)
    if HAS_PREFIX:
        # grouped decode: this request's tokens [0, kv0) are attended by the prefix kernel
        kv0 = tl.load(PfxLens + b).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(seq_len - kv0, num_splits), BLOCK_N) * BLOCK_N
        start = kv0 + s * chunk
    elif WINDOW > 0:
        # the last WINDOW tokens only, split as a sequence of that length would be
        lo = tl.maximum(seq_len - WINDOW, 0)
        chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
        start = lo + s * chunk
    else:
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = s * chunk
    end = tl.minimum(start + chunk, seq_len)
    if start < end:
        row = tl.load(ReqRows + b).to(tl.int64)
        hi = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + hi
        hmask = hi < GROUP
        d = tl.arange(0, BLOCK_D)
        if BLOCK_D == HEAD_DIM:
            dmask = d < BLOCK_D  # all true; folded by the compiler
        else:
            dmask = d < HEAD_DIM

        if STORE_KV:
            if end == seq_len:  # the split holding the new token: one per (KV head, request)
                slot = tl.load(ReqToToken + row * stride_rt + seq_len - 1).to(tl.int64)
                _store_new_token(K + b * stride_knt + kvh * stride_knh,
                                 V + b * stride_vnt + kvh * stride_vnh,
                                 KC + slot * stride_kt + kvh * stride_kh,
                                 VC + slot * stride_vt + kvh * stride_vh,
                                 d, dmask, KV_FP8, KV_SCALE, FP8_SW_ROUND)
        q = tl.load(Q + qrow * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = attend_slots(
            q, ReqToToken + row * stride_rt, KC + kvh * stride_kh, VC + kvh * stride_vh,
            start, end, stride_kt, stride_vt, d, dmask, sm_scale_log2,
            BLOCK_H, BLOCK_N, HEAD_DIM, BLOCK_D, F32_DOT, KV_FP8, KV_SCALE)

        if HAS_PREFIX and DIRECT:
            m_i, l_i, acc = _merge_prefix_partials(
                m_i, l_i, acc, PfxO, PfxLse, Ctrl, b, heads, hmask, d, dmask, kv0,
                stride_pb, stride_ph, stride_pp, stride_plb, stride_plh, PFX_BLOCK_N, PMAX)
        out = acc / l_i[:, None]
        omask = hmask[:, None] & dmask[None, :]
        if DIRECT:
            tl.store(Out + qrow * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=omask)
        else:
            tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + d[None, :],
                     out, mask=omask)
            tl.store(MidLse + b * stride_lb + heads * stride_lh + s, m_i + tl.log2(l_i),
                     mask=hmask)


# ----------------------------------------------------------------------------------------
# Decode, stage 2: grid (Hq, B). Merges the non-empty splits of one (request, head).
# ----------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh", "by_qo"],
            do_not_specialize_on_alignment=["SeqLens", "PfxLens", "Ctrl", "QoIndptr", "ExtendLens"])
def decode_reduce_kernel(MidO, MidLse, SeqLens, Out, num_splits,
                         stride_mb, stride_mh, stride_ms,
                         stride_lb, stride_lh,
                         stride_ot, stride_oh,
                         PfxLens, PfxO, PfxLse, Ctrl, QoIndptr, ExtendLens, by_qo,
                         stride_pb, stride_ph, stride_pp,
                         stride_plb, stride_plh,
                         BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr, HAS_PREFIX: tl.constexpr = False,
                         PFX_BLOCK_N: tl.constexpr = 64, PMAX: tl.constexpr = 4,
                         WINDOW: tl.constexpr = 0, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    orow = b
    live = seq_len >= 0  # (a tensor, as the branch's)
    if by_qo != 0:  # as in the partial kernel; other requests' rows are the extend kernel's
        orow = tl.load(QoIndptr + b).to(tl.int64)
        live = tl.load(ExtendLens + b) == 1
    if HAS_PREFIX:
        kv0 = tl.load(PfxLens + b).to(tl.int32)
    elif WINDOW > 0:
        kv0 = tl.maximum(seq_len - WINDOW, 0)  # where the partial kernel's splits start
    else:
        kv0 = 0
    chunk = tl.cdiv(tl.cdiv(seq_len - kv0, num_splits), BLOCK_N) * BLOCK_N
    s = tl.arange(0, BLOCK_S)
    valid = (s < num_splits) & (s * chunk < seq_len - kv0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + s, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_PREFIX:
        # the prefix kernel's partials of this (request, head): one more set of splits
        p_splits = tl.maximum(tl.load(Ctrl + 1).to(tl.int32), 1)
        pchunk = tl.cdiv(tl.cdiv(kv0, p_splits), PFX_BLOCK_N) * PFX_BLOCK_N
        pp = tl.arange(0, PMAX)
        pvalid = (pp < p_splits) & (pp * pchunk < kv0)
        lse_p = tl.load(PfxLse + b * stride_plb + h * stride_plh + pp, mask=pvalid,
                        other=float("-inf"))
        m = tl.maximum(m, tl.max(lse_p, 0))
    w = tl.exp2(lse - m)  # 0 for empty splits
    o = tl.load(MidO + b * stride_mb + h * stride_mh + s[:, None] * stride_ms + d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0.0)
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w, 0)
    if HAS_PREFIX:
        w_p = tl.exp2(lse_p - m)
        o_p = tl.load(PfxO + b * stride_pb + h * stride_ph + pp[:, None] * stride_pp + d[None, :],
                      mask=pvalid[:, None] & dmask[None, :], other=0.0)
        num += tl.sum(w_p[:, None] * o_p, 0)
        den += tl.sum(w_p, 0)
    out = num / den
    tl.store(Out + orow * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty),
             mask=d < tl.where(live, HEAD_DIM, 0))  # dmask, or none for a request not ours


@triton.jit
def _store_new_token(K, V, KC, VC, d, dmask, KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr,
                     FP8_SW_ROUND: tl.constexpr):
    """One KV head's new K/V (at K, V) into its pool slot (at KC, VC), encoded as the store
    kernel does. The barrier makes the stores visible to this program's other threads, which
    read the slot back in attend_slots: those are coherent loads through the same SM's L1
    (ld.global, not the read-only ld.global.nc; tests/test_decode_store_kv.py checks the PTX)."""
    store_encoded(KC + d, tl.load(K + d, mask=dmask), dmask, KV_FP8, KV_SCALE, FP8_SW_ROUND)
    store_encoded(VC + d, tl.load(V + d, mask=dmask), dmask, KV_FP8, KV_SCALE, FP8_SW_ROUND)
    tl.debug_barrier()


@triton.jit
def _merge_prefix_partials(m_i, l_i, acc, PfxO, PfxLse, Ctrl, b, heads, hmask, d, dmask, kv0,
                           stride_pb, stride_ph, stride_pp, stride_plb, stride_plh,
                           PFX_BLOCK_N: tl.constexpr, PMAX: tl.constexpr):
    """Fold the prefix kernel's normalised partials (o_p, log2-sum-exp lse_p) of request b
    into an unnormalised online-softmax state (m_i, l_i, acc) over [BLOCK_H] heads.
    kv0 = 0 (request not grouped) leaves the state as it was."""
    p_splits = tl.maximum(tl.load(Ctrl + 1).to(tl.int32), 1)
    pchunk = tl.cdiv(tl.cdiv(kv0, p_splits), PFX_BLOCK_N) * PFX_BLOCK_N
    for p in tl.static_range(PMAX):
        pv = heads * 0 + p  # as a vector: the interpreter rejects vector & scalar masks
        ok = hmask & (pv < p_splits) & (pv * pchunk < kv0)
        lse_p = tl.load(PfxLse + b * stride_plb + heads * stride_plh + p, mask=ok,
                        other=float("-inf"))
        o_p = tl.load(PfxO + b * stride_pb + heads[:, None] * stride_ph + p * stride_pp
                      + d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        m_new = tl.maximum(m_i, lse_p)
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(lse_p - m_new)  # 0 where no partial
        acc = acc * alpha[:, None] + o_p * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    return m_i, l_i, acc


# ----------------------------------------------------------------------------------------
# Grouped decode, shared prefix: persistent grid. Work item w = (tile t, KV head, split p)
# with the KV head fastest; items past num_tiles * HKV * P are none (the grid is sized by
# capacity in CUDA graphs and the live counts are read from Ctrl). A tile serves up to
# BLOCK_M // GROUP requests that share the prefix [0, L): its BLOCK_M query rows are the
# members' GROUP query heads of this KV head, so every K/V block is loaded once and
# multiplied by all of them (a [BLOCK_M, BLOCK_N] product instead of BLOCK_M / GROUP
# separate reads). Split p covers [p * chunk, min((p + 1) * chunk, L)) with
# chunk = roundup(cdiv(L, P), BLOCK_N); it writes each member's normalised partial output
# and its log2-sum-exp, merged later with the member's suffix.
# ----------------------------------------------------------------------------------------
# Ctrl and the tile/member arrays are slices of the step's packed group metadata.
@triton.jit(do_not_specialize_on_alignment=["Ctrl", "TileRow", "TileLen", "TileMStart",
                                             "TileMCount", "Members"])
def prefix_attn_kernel(Q, KC, VC, ReqToToken, Ctrl, TileRow, TileLen, TileMStart, TileMCount,
                       Members, PfxO, PfxLse, sm_scale_log2,
                       stride_qt, stride_qh,
                       stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_rt,
                       stride_pb, stride_ph, stride_pp,
                       stride_plb, stride_plh,
                       HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       F32_DOT: tl.constexpr, KV_FP8: tl.constexpr = False,
                       KV_SCALE: tl.constexpr = 1.0, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.load(Ctrl).to(tl.int32)
    p_splits = tl.maximum(tl.load(Ctrl + 1).to(tl.int32), 1)
    total = num_tiles * HKV * p_splits
    r = tl.arange(0, BLOCK_M)
    mi = r // GROUP
    hj = r % GROUP
    d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        dmask = d < BLOCK_D
    else:
        dmask = d < HEAD_DIM
    for w in range(pid, total, nprog):
        kvh = w % HKV
        tp = w // HKV
        p = tp % p_splits
        t = tp // p_splits
        plen = tl.load(TileLen + t).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(plen, p_splits), BLOCK_N) * BLOCK_N
        start = p * chunk
        end = tl.minimum(start + chunk, plen)
        if start < end:
            row = tl.load(TileRow + t)
            mstart = tl.load(TileMStart + t)
            mcount = tl.load(TileMCount + t).to(tl.int32)
            rmask = mi < mcount
            b = tl.load(Members + mstart + mi, mask=rmask, other=0)
            heads = kvh * GROUP + hj
            q = tl.load(Q + b[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=rmask[:, None] & dmask[None, :], other=0.0)
            m_i, l_i, acc = attend_slots(
                q, ReqToToken + row * stride_rt, KC + kvh * stride_kh, VC + kvh * stride_vh,
                start, end, stride_kt, stride_vt, d, dmask, sm_scale_log2,
                BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, F32_DOT, KV_FP8, KV_SCALE)
            out = acc / l_i[:, None]
            tl.store(PfxO + b[:, None] * stride_pb + heads[:, None] * stride_ph + p * stride_pp
                     + d[None, :], out, mask=rmask[:, None] & dmask[None, :])
            tl.store(PfxLse + b * stride_plb + heads * stride_plh + p, m_i + tl.log2(l_i),
                     mask=rmask)
