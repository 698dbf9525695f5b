"""FP8 (float8_e4m3fn) math: quantizing weights and activations, and the FP8 linear.

A quantized weight is `weight` [out, in] in float8 plus `weight_scale` [out, G] float32:
row r's input features fall in G equal groups, group g dequantizes as
`weight[r, group g] * weight_scale[r, g]`. G = 1 is a per-output-channel scale (what
on-the-fly quantization and per-tensor/per-channel checkpoints give); G > 1 holds a
checkpoint's block scales expanded along the rows (engine/loading/checkpoint_formats.py).

Activations get a dynamic scale per token (row), computed in the forward, so the GEMM is
`(x_q * sx) @ (w_q * sw)^T = sx * (x_q @ w_q^T) * sw^T`: one `torch._scaled_mm` with
row-wise scales (Hopper's FP8 tensor cores; PyTorch's CPU build runs the same op, which is
how the CPU tests exercise this exact code path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE, Fp8Rows

# Rows of activations up to which the weight-only kernel beats `torch._scaled_mm` (H200,
# Llama-3-8B shapes: scripts/bench_layer_kernels.py).
W8A16_MAX_ROWS = 16


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast: e4m3fn has no infinity, and an out-of-range cast may give NaN."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] -> (float8 [N, K], float32 scale [N, 1]) with one scale per row, chosen so
    the row's largest magnitude maps to FP8_MAX."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_SCALE) / FP8_MAX
    return to_fp8(x.float() / scale), scale


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 [out, in] with scale [out, G] -> `dtype` [out, in]."""
    out, groups = weight_scale.shape
    w = weight.float().view(out, groups, -1) * weight_scale.unsqueeze(-1)
    return w.view(weight.shape).to(dtype)


def scaled_mm_ok(weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    # torch._scaled_mm wants both GEMM dims of the weight in multiples of 16, and one scale per row.
    return weight_scale.shape[1] == 1 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def takes_weight_only_kernel(x: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether `fp8_linear` multiplies x by the weight with the weight-only GEMV: on the
    GPU, a decode-sized batch, per-channel scales or block scales whose groups the kernel
    steps through (a power-of-two width, like checkpoints' 128)."""
    if not x.is_cuda:
        return False
    from engine.kernels.gemv import scale_group

    return scale_group(x.shape[-1], weight_scale) >= 0 and x.numel() // x.shape[-1] <= W8A16_MAX_ROWS


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, quantize_input: bool = True,
               keep_splits: bool = False, fast_accum: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) for an FP8 weight; output in x's dtype. With `keep_splits` the
    weight-only kernel may return a `SplitSums` (engine/kernels/split_sums.py) instead. x may
    come quantized already (`Fp8Rows`, from the kernel before the linear).

    On the GPU, decode-sized batches run the weight-only kernel (`w8a16_linear`:
    bf16 activations, half the weight bytes; per-channel scales, or block scales applied per
    K step). Otherwise per-channel weights with dynamic per-token activations run as one
    `torch._scaled_mm`; block-scaled weights above decode sizes, weight-only checkpoints (no
    activation quantization) and shapes `_scaled_mm` refuses dequantize the weight and run a
    plain matmul: the same math, slower.
    `fast_accum`: `_scaled_mm` accumulates in the tensor cores' own precision (Hopper), not
    promoting partial sums to float32 along K; faster, a little less exact.
    """
    if isinstance(x, Fp8Rows):
        return _scaled_mm(x.q, x.scale, weight, weight_scale, bias, x.dtype, fast_accum)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if takes_weight_only_kernel(x, weight_scale):
        from engine.kernels.gemv import w8a16_linear
        y = w8a16_linear(rows, weight, weight_scale,
                         keep_splits=keep_splits and bias is None and x.dim() == 2)
        if not isinstance(y, torch.Tensor):
            return y  # a SplitSums
        y = y + bias if bias is not None else y
        return y.view(*shape[:-1], weight.shape[0])
    if not (quantize_input and scaled_mm_ok(weight, weight_scale)):
        return F.linear(x, dequantize(weight, weight_scale, x.dtype), bias)
    if x.is_cuda:
        from engine.kernels.fp8 import quantize_rows as quantize_rows_kernel
        x_q, x_scale = quantize_rows_kernel(rows)
    else:
        x_q, x_scale = quantize_rows(rows)
    y = _scaled_mm(x_q, x_scale, weight, weight_scale, bias, x.dtype, fast_accum)
    return y.view(*shape[:-1], weight.shape[0])


def _scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
               fast_accum: bool = False) -> torch.Tensor:
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=dtype,
                         use_fast_accum=fast_accum)
    return y + bias if bias is not None else y


class Fp8LinearMethod:
    """How a linear layer with a float8 weight multiplies (engine/layers/linear.py
    `LinearBase.quant_method`, set with its `weight_scale` by engine/layers/fp8.py): handed
    to the layer from here, so the layers do not import the quantization."""

    takes_weight_only_kernel = staticmethod(takes_weight_only_kernel)

    @staticmethod
    def apply(layer: torch.nn.Module, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None,
              keep_splits: bool) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, layer.quantize_input,
                          keep_splits, layer.fast_accum)


FP8_LINEAR = Fp8LinearMethod()


def takes_quantized_input(layer: torch.nn.Module, rows: int) -> bool:
    """Whether an FP8 `layer` (a LinearBase) would quantize an input of `rows` rows itself
    for `torch._scaled_mm`, so the kernel before it may hand it `Fp8Rows` instead."""
    return (layer.weight_scale is not None and layer.quantize_input and rows > W8A16_MAX_ROWS
            and scaled_mm_ok(layer.weight, layer.weight_scale))
