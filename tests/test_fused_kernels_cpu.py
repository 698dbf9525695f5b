"""The fused element-wise kernels (engine/layers/fused_kernels.py) checked without a GPU:
tests/test_fused_kernels.py through Triton's interpreter, and every variant compiled for sm_90."""
from __future__ import annotations

import pytest
from triton_on_cpu import compile_for_sm90, run_under_interpreter


def test_fused_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_fused_kernels.py")


def test_rope_kernel_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.layers.fused_kernels import _rope_kernel

    types = dict(Q="*bf16", K="*bf16", V="*bf16", Cache="*fp32", QOut="*bf16", KOut="*bf16",
                 VOut="*bf16", QNormW="*bf16", KNormW="*bf16", eps="fp32")
    for has_norm in (False, True):  # Qwen3-30B-A3B's heads: 32 q, 4 kv, 128 wide
        compile_for_sm90(_rope_kernel, types, dict(HQ=32, HKV=4, HALF=64, HAS_NORM=has_norm,
                                                   BLOCK_H=16, BLOCK_HALF=64))
