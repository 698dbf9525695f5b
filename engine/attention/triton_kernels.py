"""Triton kernels for paged (page size 1) attention: KV store, split-KV decode, ragged extend.

Conventions shared by all kernels:
- The KV cache of one layer is [num_slots + 1, Hkv, D]; a request's token j lives at slot
  req_to_token[row, j]. Slot indices are widened to int64 before any address arithmetic
  (slot * row stride can pass 2**31 elements on large pools).
- Softmax runs in base 2: logits are scaled by scale * log2(e) and the log-sum-exp written
  by the decode partials is log2-based too.
- BLOCK_D is the head dim rounded up to a power of two (at least 16); loads along D are
  masked only when it differs from HEAD_DIM.
- F32_DOT: run tl.dot on fp32 operands in IEEE precision (fp32 models, and the Triton CPU
  interpreter, whose bf16 dot is wrong). Otherwise the dot takes the storage dtype
  (bf16/fp16) with fp32 accumulation.
- WINDOW (constexpr, 0 = none): sliding-window attention (Mistral, Qwen2 layers): a query at
  position p sees the keys at positions p - WINDOW + 1 .. p. Decode starts its sweep at
  seq_len - WINDOW; extend starts at the tile's first visible key and masks per row.
- KV_FP8: the pool is float8_e4m3 (see "FP8 KV pool" below); K/V are dequantized to the
  query's dtype right after their loads, so everything after is as for a bf16 pool.

Specialization (cold start): Triton compiles one binary per distinct launch key. Besides
the constexprs and num_warps/num_stages, the key holds, for every non-constexpr int, whether
it == 1 (then it becomes a constant) or is divisible by 16, and for every pointer whether
its address is 16-byte aligned (Triton 3.6: `native_specialize_impl`, called by the binder
`create_function_from_signature` builds in runtime/jit.py; the "D" attribute becomes
tt.divisibility=16). Arguments whose value or address varies from step to step would make a
fresh replica compile again on its first requests of a new shape, so the kernels below opt
out with `do_not_specialize` (ints) and `do_not_specialize_on_alignment` (pointers) where
the hint buys nothing: lengths and split counts only bound loops or feed scalar arithmetic;
per-request metadata pointers (slices of the step's one flat int64 upload, whose offsets
depend on the other fields' lengths) are read one scalar at a time. Strides of Q/K/V, the
KV pool and the output stay specialised: they are fixed per model and their divisibility
lets the vectorised K/V loads and output stores use 16-byte accesses.

This module imports triton at its top: import it only when the Triton backend is chosen.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# ----------------------------------------------------------------------------------------
# FP8 KV pool (kv_cache_dtype="fp8_e4m3"; KVPool.encode/decode are the torch version).
# KV_FP8 (constexpr) switches it on; off, the helpers return their input unchanged, so the
# bf16/fp16/fp32 kernels compile exactly as without them. KV_SCALE is the pool's one scale
# (a constexpr: fixed per pool; 1.0 skips the multiply and divide). The pool holds
# float8_e4m3fn(clamp(x / KV_SCALE, +-448)), rounded to nearest even; loads dequantize in
# registers to the query's dtype, (stored * KV_SCALE).to(q.dtype), as the torch backend
# does, and the dots and accumulation are unchanged from there.
# FP8_SW_ROUND: Triton's CPU interpreter casts float32 -> float8 wrongly (it rounds half up
# and drops the carry into the exponent: 0.49 -> 0.25), so under it the value is first
# rounded to the e4m3 grid in float32 and the cast only truncates zero bits. The GPU's
# cast (cvt.rn.satfinite) rounds correctly and never takes that path.
# ----------------------------------------------------------------------------------------
@triton.jit
def _round_to_e4m3(x):
    """float32 |x| <= 448 -> the nearest float8_e4m3fn value (ties to even), as float32."""
    bits = x.to(tl.uint32, bitcast=True)
    # normal range: keep 3 of the 23 mantissa bits; the add carries into the exponent
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # below 2**-6 (subnormal e4m3) the step is a fixed 2**-9: float32's step at 2**14
    a = tl.abs(x)
    sub = (a + 16384.0) - 16384.0
    sub = tl.where((bits >> 31) != 0, -sub, sub)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _kv_encode(x, KV_SCALE: tl.constexpr, FP8_SW_ROUND: tl.constexpr):
    """New K/V values -> what an fp8 pool stores (float8e4nv)."""
    x = x.to(tl.float32)
    if KV_SCALE != 1.0:
        x = x / KV_SCALE
    # e4m3fn has no infinity: saturate rather than let an out-of-range cast give NaN
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if FP8_SW_ROUND:
        x = _round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _kv_decode(x, dtype: tl.constexpr, KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr):
    """Loaded pool values -> `dtype` (the query's) for the dots; identity unless KV_FP8."""
    if KV_FP8:
        if KV_SCALE != 1.0:
            return (x.to(tl.float32) * KV_SCALE).to(dtype)
        else:
            return x.to(dtype)
    else:
        return x


@triton.jit
def _kv_roundtrip(x, KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr, FP8_SW_ROUND: tl.constexpr):
    """New K/V read from the step's inputs (extend) -> the values the pool now holds for
    them, so new tokens attend exactly as if read back from the pool; identity unless KV_FP8."""
    if KV_FP8:
        return _kv_decode(_kv_encode(x, KV_SCALE, FP8_SW_ROUND), x.dtype, KV_FP8, KV_SCALE)
    else:
        return x


@triton.jit
def _attend_slots(q, tok, k_base, v_base, start, end, stride_kt, stride_vt, d, dmask,
                  sm_scale_log2, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
                  KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr):
    """Online softmax of the query rows q ([ROWS, BLOCK_D]) over the tokens [start, end) of
    one req_to_token row (`tok`), one KV head (`k_base`, `v_base`); returns the
    unnormalised state (m_i, l_i, acc). Shared by the decode and the prefix kernels."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n in range(start, end, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        nmask = offs < end
        # Masked-off positions read slot 0 (the padding slot, always valid memory).
        slots = tl.load(tok + offs, mask=nmask, other=0).to(tl.int64)
        if BLOCK_D == HEAD_DIM:
            k = tl.load(k_base + slots[:, None] * stride_kt + d[None, :])
        else:
            k = tl.load(k_base + slots[:, None] * stride_kt + d[None, :],
                        mask=dmask[None, :], other=0.0)
        k = _kv_decode(k, q.dtype, KV_FP8, KV_SCALE)
        qk = _dot(q, tl.trans(k), F32_DOT) * sm_scale_log2  # [rows, BLOCK_N]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # masked: slot 0 may hold garbage (even NaN) from padded batch entries, and
        # p = 0 there must not meet it
        v = tl.load(v_base + slots[:, None] * stride_vt + d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.0)
        v = _kv_decode(v, q.dtype, KV_FP8, KV_SCALE)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
        m_i = m_new
    return m_i, l_i, acc


# ----------------------------------------------------------------------------------------
# KV store: cache[slot[t]] = new[t] for K and V in one launch.
# ----------------------------------------------------------------------------------------
# Slots: a slice of the step's flat upload (offset depends on the token count).
@triton.jit(do_not_specialize_on_alignment=["Slots"])
def store_kv_kernel(K, V, KC, VC, Slots,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kct, stride_kch, stride_vct, stride_vch,
                    HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                    KV_FP8: tl.constexpr = False, KV_SCALE: tl.constexpr = 1.0,
                    FP8_SW_ROUND: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < HKV) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    if KV_FP8:
        k = _kv_encode(k, KV_SCALE, FP8_SW_ROUND)
    tl.store(KC + slot * stride_kct + h[:, None] * stride_kch + d[None, :],
             k.to(KC.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if KV_FP8:
        v = _kv_encode(v, KV_SCALE, FP8_SW_ROUND)
    tl.store(VC + slot * stride_vct + h[:, None] * stride_vch + d[None, :],
             v.to(VC.dtype.element_ty), mask=mask)


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
# num_splits and the log-sum-exp strides (multiples of it) vary with batch size and
# sequence length in eager decode; ReqRows/SeqLens/PfxLens/Ctrl are step metadata.
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"],
            do_not_specialize_on_alignment=["ReqRows", "SeqLens", "PfxLens", "Ctrl"])
def decode_partial_kernel(Q, KC, VC, ReqToToken, ReqRows, SeqLens, Out, MidO, MidLse,
                          PfxLens, PfxO, PfxLse, Ctrl,
                          sm_scale_log2, num_splits,
                          stride_qt, stride_qh,
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
                          KV_SCALE: tl.constexpr = 1.0, WINDOW: tl.constexpr = 0):
    kvh = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
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

        q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = _attend_slots(
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
            tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=omask)
        else:
            tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + d[None, :],
                     out, mask=omask)
            tl.store(MidLse + b * stride_lb + heads * stride_lh + s, m_i + tl.log2(l_i),
                     mask=hmask)


# ----------------------------------------------------------------------------------------
# Decode, stage 2: grid (Hq, B). Merges the non-empty splits of one (request, head).
# ----------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"],
            do_not_specialize_on_alignment=["SeqLens", "PfxLens", "Ctrl"])
def decode_reduce_kernel(MidO, MidLse, SeqLens, Out, num_splits,
                         stride_mb, stride_mh, stride_ms,
                         stride_lb, stride_lh,
                         stride_ot, stride_oh,
                         PfxLens, PfxO, PfxLse, Ctrl,
                         stride_pb, stride_ph, stride_pp,
                         stride_plb, stride_plh,
                         BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr, HAS_PREFIX: tl.constexpr = False,
                         PFX_BLOCK_N: tl.constexpr = 64, PMAX: tl.constexpr = 4,
                         WINDOW: tl.constexpr = 0):
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
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
    tl.store(Out + b * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)


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
                       KV_SCALE: tl.constexpr = 1.0):
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
            m_i, l_i, acc = _attend_slots(
                q, ReqToToken + row * stride_rt, KC + kvh * stride_kh, VC + kvh * stride_vh,
                start, end, stride_kt, stride_vt, d, dmask, sm_scale_log2,
                BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, F32_DOT, KV_FP8, KV_SCALE)
            out = acc / l_i[:, None]
            tl.store(PfxO + b[:, None] * stride_pb + heads[:, None] * stride_ph + p * stride_pp
                     + d[None, :], out, mask=rmask[:, None] & dmask[None, :])
            tl.store(PfxLse + b * stride_plb + heads * stride_plh + p, m_i + tl.log2(l_i),
                     mask=rmask)


@triton.jit
def _load_kv(kp, vp, dmask, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A full [BLOCK_N, BLOCK_D] block of K and of V (masked along D only when padded)."""
    if BLOCK_D == HEAD_DIM:
        return tl.load(kp), tl.load(vp)
    else:
        return (tl.load(kp, mask=dmask[None, :], other=0.0),
                tl.load(vp, mask=dmask[None, :], other=0.0))


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, mask, MASKED: tl.constexpr,
                  F32_DOT: tl.constexpr, EMPTY_ROWS: tl.constexpr = False):
    """One online-softmax update of (m_i, l_i, acc) with a [BLOCK_N, D] block of K and V.
    EMPTY_ROWS: a row may have seen no key yet (sliding windows skip its first blocks), so
    its max stays -inf and is not subtracted (-inf - -inf would be NaN)."""
    qk = _dot(q, tl.trans(k), F32_DOT) * sm_scale_log2
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if EMPTY_ROWS:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.exp2(qk - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
    return m_new, l_i, acc


@triton.jit
def _in_window(kpos, qpos, WINDOW: tl.constexpr):
    """[rows, keys]: key position kpos is among the last WINDOW positions up to query qpos."""
    return kpos[None, :] > qpos[:, None] - WINDOW


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
@triton.jit(do_not_specialize=["num_m_blocks"],
            do_not_specialize_on_alignment=["ReqRows", "SeqLens", "ExtendLens", "QoIndptr"])
def extend_kernel(Q, K, V, KC, VC, Out, ReqToToken, ReqRows, SeqLens, ExtendLens, QoIndptr,
                  sm_scale_log2, num_m_blocks,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_kct, stride_kch, stride_vct, stride_vch,
                  stride_rt, stride_ot, stride_oh,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
                  KV_FP8: tl.constexpr = False, KV_SCALE: tl.constexpr = 1.0,
                  FP8_SW_ROUND: tl.constexpr = False, WINDOW: tl.constexpr = 0):
    h = tl.program_id(0)
    b = tl.program_id(1)
    mblk = num_m_blocks - 1 - tl.program_id(2)
    ext = tl.load(ExtendLens + b)
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
        tok = ReqToToken + row * stride_rt
        kc_base = KC + kvh * stride_kch
        vc_base = VC + kvh * stride_vch
        prefix_full = (prefix // BLOCK_N) * BLOCK_N
        for n in range(prefix_lo, prefix_full, BLOCK_N):
            slots = tl.load(tok + n + nd).to(tl.int64)
            k, v = _load_kv(kc_base + slots[:, None] * stride_kct + d[None, :],
                            vc_base + slots[:, None] * stride_vct + d[None, :],
                            dmask, BLOCK_D, HEAD_DIM)
            k = _kv_decode(k, q.dtype, KV_FP8, KV_SCALE)
            v = _kv_decode(v, q.dtype, KV_FP8, KV_SCALE)
            if WINDOW > 0:
                m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2,
                                              _in_window(n + nd, qpos, WINDOW), True, F32_DOT,
                                              True)
            else:
                m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, 0,
                                              False, F32_DOT)
        if prefix_full < prefix:
            offs = prefix_full + nd
            nmask = offs < prefix
            slots = tl.load(tok + offs, mask=nmask, other=0).to(tl.int64)  # 0: padding slot
            k = tl.load(kc_base + slots[:, None] * stride_kct + d[None, :],
                        mask=dmask[None, :], other=0.0)
            v = tl.load(vc_base + slots[:, None] * stride_vct + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            k = _kv_decode(k, q.dtype, KV_FP8, KV_SCALE)
            v = _kv_decode(v, q.dtype, KV_FP8, KV_SCALE)
            mask = nmask[None, :]
            if WINDOW > 0:
                mask = mask & _in_window(offs, qpos, WINDOW)
            m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2,
                                          mask, True, F32_DOT, WINDOW > 0)

        # 2) the new tokens, causal: new token j sees new tokens 0..j (with an fp8 pool,
        # rounded as the store kernel just wrote them, so they match what later steps read)
        k_base = K + q0 * stride_kt + kvh * stride_kh
        v_base = V + q0 * stride_vt + kvh * stride_vh
        # keys below the tile's first query row are visible to every row (and < ext)
        full_end = ((mblk * BLOCK_M) // BLOCK_N) * BLOCK_N
        for n in range(new_lo, full_end, BLOCK_N):
            offs = n + nd
            k, v = _load_kv(k_base + offs[:, None] * stride_kt + d[None, :],
                            v_base + offs[:, None] * stride_vt + d[None, :],
                            dmask, BLOCK_D, HEAD_DIM)
            k = _kv_roundtrip(k, KV_FP8, KV_SCALE, FP8_SW_ROUND)
            v = _kv_roundtrip(v, KV_FP8, KV_SCALE, FP8_SW_ROUND)
            if WINDOW > 0:
                m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2,
                                              _in_window(prefix + offs, qpos, WINDOW), True,
                                              F32_DOT, True)
            else:
                m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, 0,
                                              False, F32_DOT)
        end = tl.minimum(ext, (mblk + 1) * BLOCK_M)
        for n in range(full_end, end, BLOCK_N):
            offs = n + nd
            nmask = offs < ext
            k = tl.load(k_base + offs[:, None] * stride_kt + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            v = tl.load(v_base + offs[:, None] * stride_vt + d[None, :],
                        mask=nmask[:, None] & dmask[None, :], other=0.0)
            k = _kv_roundtrip(k, KV_FP8, KV_SCALE, FP8_SW_ROUND)
            v = _kv_roundtrip(v, KV_FP8, KV_SCALE, FP8_SW_ROUND)
            causal = (offs[None, :] <= m_offs[:, None]) & nmask[None, :]
            if WINDOW > 0:
                causal = causal & _in_window(prefix + offs, qpos, WINDOW)
            m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, causal,
                                          True, F32_DOT, WINDOW > 0)

        out = acc / l_i[:, None]
        tl.store(Out + (q0 + m_offs)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
