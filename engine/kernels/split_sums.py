"""A linear's output left as its GEMV's K-slice partial sums, for the next kernel to add up.

At batch 1 the GEMV (engine/kernels/gemv.py) cuts a long K into slices and needs a second
launch to add them; in a decode step of a few hundred tiny kernels each launch boundary
costs about a microsecond even under PDL. A linear whose consumer is one of our fused
kernels (RMSNorm, SiLU-and-mul, RoPE: engine/kernels/fused.py) hands that consumer
the partials instead, and the consumer's loads add them: in split order, rounded to the
output dtype, exactly as the summing launch would (`add_split_sums`, engine/kernels/inline.py),
so the result is bit for bit the same.

A linear produces one only when its `split_sums_ok` is set, by the module that owns the
consumer and handles both forms; a consumer without such a kernel calls `total()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitSums:
    """Also the MoE experts' weighted outputs per choice ([top_k, tokens, hidden], model
    dtype, a strided view), which the next RMSNorm adds as it adds a GEMV's slices."""
    parts: torch.Tensor  # [splits, rows, out features]: float32 partial sums, or any dtype
    dtype: torch.dtype   # the output dtype

    @property
    def splits(self) -> int:
        return self.parts.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def is_cuda(self) -> bool:
        return self.parts.is_cuda

    def total(self) -> torch.Tensor:
        """The summed output [rows, out features], as the GEMV's summing launch returns it
        (float32 adds in split order, then one rounding): for consumers without a kernel
        that adds them."""
        acc = self.parts[0].to(torch.float32, copy=True)
        for part in self.parts[1:]:
            acc += part
        return acc.to(self.dtype)
