"""Row-wise argmax of a few rows of logits, in two short launches.

torch reduces each row of an argmax in one thread block: at batch 1 a 128k vocabulary
then takes ~27 us on the H200, a tenth of the LM head before it (bench_offline.py
--profile-w3). Here each row is cut into blocks: the first launch finds every block's
maximum and its first index, the second each row's best block. Ties go to the lowest
index, as in torch.argmax. Larger batches keep torch's kernel: one block per row already
fills the GPU there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_launch, pdl_prologue
from engine.kernels.precompile import compile_in_place

MAX_ROWS = 16  # above this torch's one block per row has rows enough
BLOCK = 2048  # ~63 blocks per row of a 128k vocabulary


@triton.jit
def _block_argmax_kernel(X, BestValue, BestIndex, V, stride_x, num_blocks,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=-float("inf"))
    x = tl.where(x != x, float("inf"), x)  # a NaN wins, as in torch (its first, before any inf)
    best = row * num_blocks + block
    tl.store(BestValue + best, tl.max(x, axis=0))
    tl.store(BestIndex + best, block * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))


@triton.jit
def _row_argmax_kernel(BestValue, BestIndex, Out, num_blocks, BLOCKS: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCKS)
    values = tl.load(BestValue + row * num_blocks + offs, mask=offs < num_blocks, other=-float("inf"))
    # blocks run in index order, so the first best block holds the row's first best index
    first = tl.argmax(values, axis=0, tie_break_left=True)
    tl.store(Out + row, tl.load(BestIndex + row * num_blocks + first).to(tl.int64))


def argmax_rows(logits: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """logits [B, V] -> [B] int64, each row's first maximum, as `logits.argmax(-1)` (a row
    with NaNs: here the first NaN or +inf, there the first NaN). `use_kernel`: None takes
    the kernels on a GPU for 1 to MAX_ROWS rows, torch otherwise."""
    rows, vocab = logits.shape
    if use_kernel is None:
        use_kernel = logits.is_cuda and 0 < rows <= MAX_ROWS
    if not use_kernel:
        return logits.argmax(dim=-1)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_blocks = triton.cdiv(vocab, BLOCK)
    best_value = torch.empty((rows, num_blocks), dtype=torch.float32, device=logits.device)
    best_index = torch.empty((rows, num_blocks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    pdl = pdl_launch(logits.device)
    _block_argmax_kernel[(rows, num_blocks)](logits, best_value, best_index, vocab, logits.stride(0),
                                             num_blocks, BLOCK=BLOCK, **pdl)
    _row_argmax_kernel[(rows,)](best_value, best_index, out, num_blocks,
                                BLOCKS=triton.next_power_of_2(num_blocks), **pdl)
    return out


# the tokens they pick index the embedding at the next step (engine/kernels/precompile.py)
compile_in_place(_block_argmax_kernel, _row_argmax_kernel)
