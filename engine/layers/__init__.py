"""Model building blocks, written once for tensor parallelism (dense at tp size 1)."""
import functools
import os

from engine.layers.activation import SiluAndMul
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                  QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
from engine.layers.norm import RMSNorm
from engine.layers.parallel import TPContext
from engine.layers.rotary import RotaryEmbedding, get_rope
from engine.quantization.fp8 import takes_quantized_input


def bf16_gemv_rows(setting: str | None) -> int:
    """Rows up to which bf16 linears take the Triton GEMV: 1, or RADIXSERVE_BF16_GEMV_ROWS
    (2-64), an A/B not yet measured on a GPU: short prompts' extend graphs would chain their
    linears under PDL instead of draining the GPU around each cuBLAS GEMM (~3.5 us a side
    on the H200)."""
    if not setting:
        return 1
    if not (setting.strip().isdigit() and 1 <= int(setting) <= 64):
        raise ValueError(f"RADIXSERVE_BF16_GEMV_ROWS must be a whole number within 1-64, got {setting!r}")
    return int(setting)


# Rows up to which bf16 linears take the Triton GEMV (RADIXSERVE_TRITON_GEMV=0: cuBLAS always).
GEMV_ROWS = bf16_gemv_rows(os.environ.get("RADIXSERVE_BF16_GEMV_ROWS"))


def set_fused_kernels(model, enabled: bool) -> None:
    """Run every RMSNorm, RoPE and SiLU-and-mul of `model` as one Triton kernel each, and
    its one-row bf16 linears as the Triton GEMV (on GPUs; CPU tensors always take the torch
    path). A norm or SiLU-and-mul whose output only an FP8 linear reads (a module's
    `quantized_input_pairs()`) quantizes that input for it in the same launch
    (RADIXSERVE_FUSED_FP8_QUANT=0: the linear quantizes it in a launch of its own)."""
    gemv = enabled and os.environ.get("RADIXSERVE_TRITON_GEMV", "1") != "0"
    fuse_quantize = enabled and os.environ.get("RADIXSERVE_FUSED_FP8_QUANT", "1") != "0"
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul)):
            module.fused = enabled
        elif isinstance(module, LinearBase):
            module.gemv_rows = GEMV_ROWS if gemv else 0
        for producer, linear in getattr(module, "quantized_input_pairs", lambda: ())():
            fp8 = fuse_quantize and linear.weight_scale is not None
            producer.quantizes_for = functools.partial(takes_quantized_input, linear) if fp8 else None


__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
           "ReplicatedLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
           "TPContext", "VocabParallelEmbedding", "get_rope", "set_fused_kernels"]
