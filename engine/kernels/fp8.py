"""Triton kernels for FP8 weights on the GPU (also run under TRITON_INTERPRET=1).

- `w8a16_linear` (in engine/kernels/gemv.py, the GEMV it runs): y = x (w * scale)^T for a
  float8 weight with one scale per output row, the activations kept in bf16. For
  decode-sized batches the GEMM reads the weight once and is bound by those bytes, so half
  the bytes is the whole gain; quantizing the activations first (what `torch._scaled_mm`
  needs) only adds launches there.
- `quantize_rows`: the activations' per-row float8 quantization for `torch._scaled_mm` in
  one launch (the torch expression is seven). Where the kernel before the linear holds a
  whole row (RMSNorm, SiLU-and-mul: engine/kernels/fused.py), it quantizes in its own
  launch instead (`store_quantized_row`), and the row never goes to memory in bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_launch, pdl_prologue
from engine.kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE

@triton.jit
def _quantize_rows_kernel(X, Q, Scale, K, stride_x, stride_q, fp8_max, min_scale,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + row * stride_x + k0 + offs, mask=offs < K - k0, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # IEEE division (Triton's `/` is approximate), as the torch expression divides
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), min_scale), fp8_max)
    tl.store(Scale + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = offs < K - k0
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(Q + row * stride_q + k0 + offs, q.to(Q.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.quantization.fp8.quantize_rows` in one launch: x [M, K] -> (float8 [M, K],
    float32 scale [M, 1])."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE,
                                    BLOCK_K=min(2048, triton.next_power_of_2(k)), num_warps=4,
                                    **pdl_launch(x.device))
    return q, scale
