"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.kernels.split_sums import SplitSums


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fused = False  # one Triton kernel on GPUs (engine/kernels/fused.py)
        # Set by `set_fused_kernels` when an FP8 linear alone reads this norm's output: given a
        # row count, whether that linear wants its input quantized (then the kernel does it).
        self.quantizes_for: Callable[[int], bool] | None = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 for stability; the scale multiplies in the model dtype (as HF).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor | SplitSums, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual). x may be a
        linear's partial sums (engine/kernels/split_sums.py); norm(x) may come back quantized
        (`Fp8Rows`) for the FP8 linear after it."""
        if self.fused and x.is_cuda:
            from engine.kernels.fused import rmsnorm

            quantize = (self.quantizes_for is not None and isinstance(x, torch.Tensor)
                        and self.quantizes_for(x.numel() // x.shape[-1]))
            return rmsnorm(x, self.weight, self.eps, residual, quantize)
        if isinstance(x, SplitSums):
            x = x.total()
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
