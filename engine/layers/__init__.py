"""Model building blocks, written once for tensor parallelism (dense at tp size 1)."""
import functools

from engine.config import KernelConfig
from engine.layers.activation import SiluAndMul
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                  QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
from engine.layers.norm import RMSNorm
from engine.layers.parallel import TPContext
from engine.layers.rotary import RotaryEmbedding, get_rope
from engine.quantization.fp8 import takes_quantized_input


def set_fused_kernels(model, enabled: bool, kernels: KernelConfig | None = None) -> None:
    """Run every RMSNorm, RoPE and SiLU-and-mul of `model` as one Triton kernel each, and
    its bf16 linears of up to `kernels.bf16_gemv_rows` rows as the Triton GEMV (on GPUs; CPU
    tensors always take the torch path). A norm or SiLU-and-mul whose output only an FP8
    linear reads (a module's `quantized_input_pairs()`) quantizes that input for it in the
    same launch (`kernels.fused_fp8_quant` off: the linear quantizes it in a launch of its
    own); a float8 gate_up GEMV applies SiLU-and-mul itself (`kernels.glu_gemv`)."""
    kernels = kernels or KernelConfig()
    gemv_rows = kernels.bf16_gemv_rows if enabled and kernels.triton_gemv else 0
    fuse_quantize = enabled and kernels.fused_fp8_quant
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul)):
            module.fused = enabled
        elif isinstance(module, LinearBase):
            module.gemv_rows = gemv_rows
            module.glu_gemv = enabled and kernels.glu_gemv
        for producer, linear in getattr(module, "quantized_input_pairs", lambda: ())():
            fp8 = fuse_quantize and linear.weight_scale is not None
            producer.quantizes_for = functools.partial(takes_quantized_input, linear) if fp8 else None


__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
           "ReplicatedLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
           "TPContext", "VocabParallelEmbedding", "get_rope", "set_fused_kernels"]
