"""Triton attention, shared parts: the conventions every kernel follows, the helpers they
share (dots, FP8 KV encode/decode, online-softmax steps, window masks) and the KV store.
The kernels: split-KV decode and the shared-prefix kernel in triton_decode.py, the ragged
extend/prefill kernel in triton_extend.py.

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
- KV_FP8: the pool is float8_e4m3 (see "FP8 KV pool" below); K/V are dequantized to
  float16 right after their loads and the dots over them take float16 operands.

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

from engine.kernels.launch import pdl_prologue


@triton.jit
def dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def pv_dot(p, v, F32_DOT: tl.constexpr):
    """Probabilities (float32) times V: p in V's dtype, or both in float32 with F32_DOT."""
    if F32_DOT:
        return dot(p, v, F32_DOT)
    else:
        return tl.dot(p.to(v.dtype), v)


# ----------------------------------------------------------------------------------------
# FP8 KV pool (kv_cache_dtype="fp8_e4m3"; KVPool.encode/decode are the torch version).
# KV_FP8 (constexpr) switches it on; off, the helpers return their input unchanged, so the
# bf16/fp16/fp32 kernels compile exactly as without them. KV_SCALE is the pool's one scale
# (a constexpr: fixed per pool; 1.0 skips the multiply and divide). The pool holds
# float8_e4m3fn(clamp(x / KV_SCALE, +-448)), rounded to nearest even.
# Loads dequantize in registers to float16, not to the query's bfloat16: every e4m3 value is
# exact in both, but sm_90 converts e4m3 pairs to f16 pairs in one instruction and has no
# direct path to bf16 (f16 -> bf16 is one quarter-rate F2F per value, which made an fp8 pool
# decode as slowly as a bf16 one on the H200). So the dots over pool K/V take
# float16 operands: the query through `f16_operand` (bf16 -> f16 is exact up to 65504), the
# probabilities as float16 (finer than bf16 on [2^-14, 1]). With a KV_SCALE other than 1 the
# scaled values must stay below 65504 (448 * KV_SCALE).
# FP8_SW_ROUND: Triton's CPU interpreter casts float32 -> float8 wrongly (it rounds half up
# and drops the carry into the exponent: 0.49 -> 0.25), so under it the value is first
# rounded to the e4m3 grid in float32 and the cast only truncates zero bits. The GPU's
# cast (cvt.rn.satfinite) rounds correctly and never takes that path.
# ----------------------------------------------------------------------------------------
@triton.jit
def round_to_e4m3(x):
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
def kv_encode(x, KV_SCALE: tl.constexpr, FP8_SW_ROUND: tl.constexpr):
    """New K/V values -> what an fp8 pool stores (float8e4nv)."""
    x = x.to(tl.float32)
    if KV_SCALE != 1.0:
        x = x / KV_SCALE
    # e4m3fn has no infinity: saturate rather than let an out-of-range cast give NaN
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if FP8_SW_ROUND:
        x = round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def kv_decode(x, KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr):
    """Loaded pool values -> float16 for the dots (identity unless KV_FP8)."""
    if KV_FP8:
        if KV_SCALE != 1.0:
            return (x.to(tl.float32) * KV_SCALE).to(tl.float16)
        else:
            return x.to(tl.float16)
    else:
        return x


@triton.jit
def f16_operand(q, KV_FP8: tl.constexpr, F32_DOT: tl.constexpr):
    """The query as the other operand of a dot over pool K (float16 with an fp8 pool; F32_DOT
    dots cast to float32 anyway). Clamped, so an out-of-range value saturates, not inf."""
    if KV_FP8 and not F32_DOT:
        return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return q


@triton.jit
def attend_slots(q, tok, k_base, v_base, start, end, stride_kt, stride_vt, d, dmask,
                  sm_scale_log2, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
                  KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr):
    """Online softmax of the query rows q ([ROWS, BLOCK_D]) over the tokens [start, end) of
    one req_to_token row (`tok`), one KV head (`k_base`, `v_base`); returns the
    unnormalised state (m_i, l_i, acc). Shared by the decode and the prefix kernels.
    Whole blocks run without masks; only a ragged last block pays for them."""
    q = f16_operand(q, KV_FP8, F32_DOT)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, tok, k_base, v_base, n, end, stride_kt, stride_vt, d,
                                      dmask, sm_scale_log2, m_i, l_i, acc, False, BLOCK_N,
                                      HEAD_DIM, BLOCK_D, F32_DOT, KV_FP8, KV_SCALE)
    if full_end < end:
        m_i, l_i, acc = _attend_block(q, tok, k_base, v_base, full_end, end, stride_kt,
                                      stride_vt, d, dmask, sm_scale_log2, m_i, l_i, acc, True,
                                      BLOCK_N, HEAD_DIM, BLOCK_D, F32_DOT, KV_FP8, KV_SCALE)
    return m_i, l_i, acc


@triton.jit
def _attend_block(q, tok, k_base, v_base, n, end, stride_kt, stride_vt, d, dmask,
                  sm_scale_log2, m_i, l_i, acc, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
                  KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr):
    """attend_slots' step over the tokens [n, n + BLOCK_N) (MASKED: those below `end`)."""
    offs = n + tl.arange(0, BLOCK_N)
    if MASKED:
        nmask = offs < end
        # Masked-off positions read slot 0 (the padding slot, always valid memory).
        slots = tl.load(tok + offs, mask=nmask, other=0).to(tl.int64)
    else:
        slots = tl.load(tok + offs).to(tl.int64)
    if BLOCK_D == HEAD_DIM:
        k = tl.load(k_base + slots[:, None] * stride_kt + d[None, :])
    else:
        k = tl.load(k_base + slots[:, None] * stride_kt + d[None, :],
                    mask=dmask[None, :], other=0.0)
    k = kv_decode(k, KV_FP8, KV_SCALE)
    qk = dot(q, tl.trans(k), F32_DOT) * sm_scale_log2  # [rows, BLOCK_N]
    if MASKED:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        # slot 0 may hold garbage (even NaN) from padded batch entries, and p = 0 there
        # must not meet it
        v = tl.load(v_base + slots[:, None] * stride_vt + d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.0)
    elif BLOCK_D == HEAD_DIM:
        v = tl.load(v_base + slots[:, None] * stride_vt + d[None, :])
    else:
        v = tl.load(v_base + slots[:, None] * stride_vt + d[None, :],
                    mask=dmask[None, :], other=0.0)
    v = kv_decode(v, KV_FP8, KV_SCALE)
    acc = acc * alpha[:, None] + pv_dot(p, v, F32_DOT)
    return m_new, l_i, acc


@triton.jit
def store_encoded(ptr, x, mask, KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr,
                  FP8_SW_ROUND: tl.constexpr):
    """New K or V values into the pool as it holds them (float8 when KV_FP8)."""
    if KV_FP8:
        x = kv_encode(x, KV_SCALE, FP8_SW_ROUND)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------
# KV store: cache[slot[t]] = new[t] for K and V in one launch. With an fp8 pool it also
# writes back into K and V (the step's inputs) the values the pool now holds, so the extend
# kernel that reads the new tokens from those inputs attends exactly what later steps will
# read from the pool, without rounding every tile again in its inner loop.
# ----------------------------------------------------------------------------------------
# Slots: a slice of the step's flat upload (offset depends on the token count).
@triton.jit(do_not_specialize_on_alignment=["Slots"])
def store_kv_kernel(K, V, KC, VC, Slots,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kct, stride_kch, stride_vct, stride_vch,
                    HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                    KV_FP8: tl.constexpr = False, KV_SCALE: tl.constexpr = 1.0,
                    FP8_SW_ROUND: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < HKV) & (d[None, :] < HEAD_DIM)
    _store_row(K + t * stride_kt + h[:, None] * stride_kh + d[None, :],
               KC + slot * stride_kct + h[:, None] * stride_kch + d[None, :], mask,
               KV_FP8, KV_SCALE, FP8_SW_ROUND)
    _store_row(V + t * stride_vt + h[:, None] * stride_vh + d[None, :],
               VC + slot * stride_vct + h[:, None] * stride_vch + d[None, :], mask,
               KV_FP8, KV_SCALE, FP8_SW_ROUND)


@triton.jit
def _store_row(src, dst, mask, KV_FP8: tl.constexpr, KV_SCALE: tl.constexpr,
               FP8_SW_ROUND: tl.constexpr):
    x = tl.load(src, mask=mask)
    if KV_FP8:
        stored = kv_encode(x, KV_SCALE, FP8_SW_ROUND)
        tl.store(dst, stored, mask=mask)
        tl.store(src, kv_decode(stored, KV_FP8, KV_SCALE).to(x.dtype), mask=mask)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def load_kv(kp, vp, dmask, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A full [BLOCK_N, BLOCK_D] block of K and of V (masked along D only when padded)."""
    if BLOCK_D == HEAD_DIM:
        return tl.load(kp), tl.load(vp)
    else:
        return (tl.load(kp, mask=dmask[None, :], other=0.0),
                tl.load(vp, mask=dmask[None, :], other=0.0))


@triton.jit
def softmax_step(q, k, v, m_i, l_i, acc, sm_scale_log2, mask, MASKED: tl.constexpr,
                  F32_DOT: tl.constexpr, EMPTY_ROWS: tl.constexpr = False):
    """One online-softmax update of (m_i, l_i, acc) with a [BLOCK_N, D] block of K and V.
    EMPTY_ROWS: a row may have seen no key yet (sliding windows skip its first blocks), so
    its max stays -inf and is not subtracted (-inf - -inf would be NaN)."""
    qk = dot(q, tl.trans(k), F32_DOT) * sm_scale_log2
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
    acc = acc * alpha[:, None] + pv_dot(p, v, F32_DOT)
    return m_new, l_i, acc


@triton.jit
def in_window(kpos, qpos, WINDOW: tl.constexpr):
    """[rows, keys]: key position kpos is among the last WINDOW positions up to query qpos."""
    return kpos[None, :] > qpos[:, None] - WINDOW
