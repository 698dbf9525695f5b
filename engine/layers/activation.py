"""Activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (the SwiGLU MLP's middle)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # one Triton kernel on GPUs (engine/layers/fused_kernels.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_cuda:
            from engine.layers.fused_kernels import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
