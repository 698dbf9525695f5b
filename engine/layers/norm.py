"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.split_sums import SplitSums


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fused = False  # one Triton kernel on GPUs (engine/layers/fused_kernels.py)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 for stability; the scale multiplies in the model dtype (as HF).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor | SplitSums, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual). x may be a
        linear's partial sums (engine/layers/split_sums.py)."""
        if self.fused and x.is_cuda:
            from engine.layers.fused_kernels import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual)
        if isinstance(x, SplitSums):
            x = x.total()
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
