"""The fused element-wise kernels (engine/kernels/fused.py) checked without a GPU:
tests/test_fused_kernels.py through Triton's interpreter, and every variant compiled for sm_90."""
from __future__ import annotations

import pytest
from triton_on_cpu import compile_for_sm90, run_under_interpreter


def test_fused_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_fused_kernels.py")


def test_rope_kernel_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.fused import _rope_kernel

    types = dict(Q="*bf16", K="*bf16", V="*bf16", Cache="*fp32", QOut="*bf16", KOut="*bf16",
                 VOut="*bf16", QNormW="*bf16", KNormW="*bf16", eps="fp32")
    for has_norm in (False, True):  # Qwen3-30B-A3B's heads: 32 q, 4 kv, 128 wide
        compile_for_sm90(_rope_kernel, types, dict(HQ=32, HKV=4, HALF=64, HAS_NORM=has_norm,
                                                   BLOCK_H=16, BLOCK_HALF=64))


def test_quantizing_norm_and_silu_compile_for_hopper():
    """The FP8-quantizing variants (engine/kernels/inline.py: store_quantized_row) at
    Llama-3-8B's widths: float8 stores with the e4m3 conversion, IEEE divisions."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.fused import _rmsnorm_kernel, _silu_and_mul_kernel

    fp8 = dict(Out="*fp8e4nv", Scale="*fp32", eps="fp32", fp8_max="fp32", min_scale="fp32")
    for residual in (False, True):
        ptx = compile_for_sm90(_rmsnorm_kernel, dict(X="*bf16", R="*bf16", W="*bf16",
                                                     ResOut="*bf16", **fp8),
                               dict(HAS_RESIDUAL=residual, BLOCK=4096, QUANTIZE=True), num_warps=16)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
    ptx = compile_for_sm90(_silu_and_mul_kernel, dict(X="*bf16", **fp8),
                           dict(BLOCK=16384, QUANTIZE=True), num_warps=16)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
