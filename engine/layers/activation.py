"""Activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.split_sums import SplitSums


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (the SwiGLU MLP's middle)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # one Triton kernel on GPUs (engine/layers/fused_kernels.py)

    def forward(self, x: torch.Tensor | SplitSums) -> torch.Tensor:
        """x may be a linear's partial sums (engine/layers/split_sums.py)."""
        if self.fused and x.is_cuda:
            from engine.layers.fused_kernels import silu_and_mul

            return silu_and_mul(x)
        if isinstance(x, SplitSums):
            x = x.total()
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
