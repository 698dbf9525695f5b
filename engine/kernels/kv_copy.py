"""Copy KV rows between two pools by slot index, one launch per tensor: the device pool's
rows to the host tier's and back.

The host pool is pinned memory, which a GPU kernel reads and writes in place through
unified addressing, so a transfer is one gather-scatter launch per layer's K and V on the
transfer stream; no staging buffer and no host thread touches the bytes. Rows are copied
as 32-bit words where their width allows it (bytes otherwise), so any KV dtype, float8
included, copies bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_prologue


@triton.jit
def _copy_rows_kernel(Src, Dst, SrcIdx, DstIdx, row_words, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    # launched without PDL: it runs on the transfer stream, whose order is set by events
    pdl_prologue(PDL)
    i = tl.program_id(0)
    src = tl.load(SrcIdx + i).to(tl.int64) * row_words
    dst = tl.load(DstIdx + i).to(tl.int64) * row_words
    for start in range(0, row_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_words
        tl.store(Dst + dst + offs, tl.load(Src + src + offs, mask=mask), mask=mask)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """[slots, ...] pool tensor -> [slots, words] of int32 (or uint8 when rows are not a
    whole number of words), same memory."""
    raw = t.view(t.shape[0], -1).view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
              dst_idx: torch.Tensor) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for pool tensors of the same row shape and dtype
    (either may be pinned host memory when the other is on the GPU)."""
    n = src_idx.numel()
    if n == 0:
        return
    s, d = as_words(src), as_words(dst)
    words = s.shape[1]
    block = min(triton.next_power_of_2(words), 1024)
    _copy_rows_kernel[(n,)](s, d, src_idx, dst_idx, words, BLOCK=block)
