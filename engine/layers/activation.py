"""Activations."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.split_sums import SplitSums
from engine.kernels.fp8_format import Fp8Rows


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (the SwiGLU MLP's middle)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # one Triton kernel on GPUs (engine/kernels/fused.py)
        # As RMSNorm's: set when an FP8 linear alone reads the output (engine/layers/norm.py).
        self.quantizes_for: Callable[[int], bool] | None = None

    def forward(self, x: torch.Tensor | SplitSums) -> torch.Tensor | Fp8Rows:
        """x may be a linear's partial sums (engine/kernels/split_sums.py); the output may
        come back quantized (`Fp8Rows`) for the FP8 linear after it."""
        if self.fused and x.is_cuda:
            from engine.kernels.fused import silu_and_mul

            quantize = (self.quantizes_for is not None and isinstance(x, torch.Tensor)
                        and self.quantizes_for(x.numel() // x.shape[-1]))
            return silu_and_mul(x, quantize)
        if isinstance(x, SplitSums):
            x = x.total()
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """x = [gate | up] -> gelu_tanh(gate) * up (Gemma's GeGLU MLP middle; torch everywhere)."""

    def forward(self, x: torch.Tensor | SplitSums) -> torch.Tensor:
        if isinstance(x, SplitSums):
            x = x.total()
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
