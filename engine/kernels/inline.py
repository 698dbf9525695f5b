"""Device functions several kernels inline (`@triton.jit` helpers called from other
kernels' bodies), kept here so that a kernel file never imports another kernel file for one:
SiLU-and-mul rounded as torch rounds it, adding a GEMV's split partial sums as its summing
launch would (engine/kernels/split_sums.py), and storing a row as float8 with its scale as
the quantizer launch would (engine/kernels/fp8.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up for gate and up in the model dtype, rounded where the torch path
    (F.silu, then the multiply) rounds, so every SiLU-and-mul kernel agrees with it."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def add_split_sums(ptrs, mask, stride_split, SPLITS: tl.constexpr, DTYPE: tl.constexpr):
    """Load through `ptrs` as DTYPE; with SPLITS > 0 they point into split 0 of partial
    sums `stride_split` elements apart, and the result is their sum, added in float32 in
    split order and rounded to DTYPE: what `_sum_splits_kernel` stores, so a consumer that
    adds the partials itself (engine/kernels/split_sums.py) reads the same values."""
    if SPLITS == 0:
        total = tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)
    else:
        acc = tl.zeros(ptrs.shape, dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(ptrs + s * stride_split, mask=mask, other=0.0)
        total = acc.to(DTYPE)
    return total


@triton.jit
def store_quantized_row(h, mask, Q, Scale, fp8_max, min_scale):
    """Store one row `h` (in the model dtype: what an unfused kernel would store) through
    pointers `Q` as float8, with its scale at `Scale`: the same arithmetic as
    `_quantize_rows_kernel`, so a fused producer gives the same bits. The row stays in the
    model dtype until its maximum is known (half the registers of float32 for bf16)."""
    amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(amax, min_scale), fp8_max)
    tl.store(Scale, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(h.to(tl.float32), scale), -fp8_max), fp8_max)
    tl.store(Q, q.to(Q.dtype.element_ty), mask=mask)
