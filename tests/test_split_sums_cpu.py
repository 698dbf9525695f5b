"""The split-sum consumers (tests/test_split_sums.py) without a GPU: through Triton's
interpreter, and each kernel's variant that adds partial sums compiled for sm_90 (where
`compile_for_sm90` also checks that PDL's wait precedes every load of them), the MoE
router's included."""
from __future__ import annotations

import pytest
from triton_on_cpu import compile_for_sm90, run_under_interpreter


def test_split_sums_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_split_sums.py")


def test_split_sum_consumers_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    import triton.language as tl

    from engine.kernels.fused import _rmsnorm_kernel, _rope_kernel, _silu_and_mul_kernel
    from engine.kernels.moe.router import _softmax_topk_kernel

    compile_for_sm90(_rmsnorm_kernel, dict(X="*fp32", R="*bf16", W="*bf16", Out="*bf16",
                                           ResOut="*bf16", eps="fp32"),
                     dict(HAS_RESIDUAL=True, BLOCK=4096, SPLITS=4), num_warps=16)
    compile_for_sm90(_silu_and_mul_kernel, dict(X="*fp32", Out="*bf16"), dict(BLOCK=1024, SPLITS=4))
    compile_for_sm90(_rope_kernel, dict(Q="*fp32", K="*fp32", V="*fp32", Cache="*fp32",
                                        QOut="*bf16", KOut="*bf16", VOut="*bf16", QNormW="*bf16",
                                        KNormW="*bf16", eps="fp32"),
                     dict(HQ=32, HKV=8, HALF=64, HAS_NORM=True, BLOCK_H=16, BLOCK_HALF=64, SPLITS=4))
    compile_for_sm90(_softmax_topk_kernel, dict(Logits="*fp32", Weights="*fp32", Ids="*i64"),
                     dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOPK=8, SPLITS=4,
                          DTYPE=tl.bfloat16))
