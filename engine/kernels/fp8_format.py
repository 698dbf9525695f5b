"""The float8 format radixserve quantizes to: e4m3fn, saturating at +-448, with scales kept
away from zero (an all-zero row still gets a finite, non-zero scale)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12


@dataclass
class Fp8Rows:
    """Activations already quantized for an FP8 linear: float8 rows `q` [M, K] and one
    float32 scale per row `scale` [M, 1]; `dtype` is the model dtype the linear returns.
    The kernel before the linear (RMSNorm, SiLU-and-mul) makes them in its own launch when
    that linear multiplies with `torch._scaled_mm` (engine/quantization/fp8.py)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def empty_quantized(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> Fp8Rows:
    """Buffers for `rows` quantized activation rows of width k (model dtype `dtype`)."""
    return Fp8Rows(torch.empty((rows, k), dtype=FP8, device=device),
                   torch.empty((rows, 1), dtype=torch.float32, device=device), dtype)
