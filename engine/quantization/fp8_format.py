"""The float8 format radixserve quantizes to: e4m3fn, saturating at +-448, with scales kept
away from zero (an all-zero row still gets a finite, non-zero scale)."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12
