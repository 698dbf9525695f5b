"""Pooling: one vector per packed sequence from its tokens' hidden states, as
sentence-transformers' Pooling and Normalize modules compute it (mean over the tokens,
the first ([CLS]) token, or the last token), optionally cut to the first `dimensions`
(Matryoshka models) before normalising."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

PoolingMode = Literal["mean", "cls", "last"]


@dataclass(frozen=True)
class PoolingSpec:
    mode: PoolingMode
    normalize: bool


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, spec: PoolingSpec,
         dimensions: int | None = None) -> torch.Tensor:
    """hidden [T, H] of sequences back to back, sequence i rows [cu[i], cu[i+1]) (a device
    tensor: nothing syncs) -> [B, dimensions or H] float32."""
    cu = cu_seqlens.long()
    if spec.mode == "cls":
        out = hidden[cu[:-1]]
    elif spec.mode == "last":
        out = hidden[cu[1:] - 1]
    else:
        lens = cu[1:] - cu[:-1]
        seq = torch.arange(len(lens), device=hidden.device).repeat_interleave(
            lens, output_size=hidden.shape[0])
        sums = torch.zeros(len(lens), hidden.shape[1], device=hidden.device, dtype=torch.float32)
        out = sums.index_add_(0, seq, hidden.float()) / lens[:, None]
    out = out.float()
    if dimensions is not None:
        out = out[:, :dimensions]
    return F.normalize(out, dim=-1) if spec.normalize else out
