"""Model building blocks, written once for tensor parallelism (dense at tp size 1)."""
from engine.layers.activation import SiluAndMul
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                  ReplicatedLinear, RowParallelLinear)
from engine.layers.norm import RMSNorm
from engine.layers.parallel import TPContext
from engine.layers.rotary import RotaryEmbedding, get_rope



def set_fused_kernels(model, enabled: bool) -> None:
    """Run every RMSNorm, RoPE and SiLU-and-mul of `model` as one Triton kernel each (on
    GPUs; CPU tensors always take the torch path)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul)):
            module.fused = enabled


__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
           "ReplicatedLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
           "TPContext", "VocabParallelEmbedding", "get_rope", "set_fused_kernels"]
