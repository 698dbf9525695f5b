"""`routing.group_by_expert` in three Triton launches (GPU; also runs under TRITON_INTERPRET=1).

The torch version is ~15 small kernels: ~60 us per MoE layer on the H200 at a few tokens and
~100 us at 480 (a third of the layer at W1's decode batch). Here the pairs are cut in chunks
of CHUNK and
1. `_count_kernel` (one program per chunk) counts the chunk's pairs of each local expert (a
   histogram; other ranks' experts fall in a spare bin);
2. `_offsets_kernel` (one program) turns the counts into each expert's first row (prefix
   sums of the block-padded totals), each chunk's first row within its expert's rows (prefix
   sums over the chunks), and labels every block with its expert (-1: none);
3. `_scatter_kernel` (one program per chunk) writes each pair to its expert's row base plus
   its chunk's offset plus its rank among the chunk's earlier pairs of the same expert,
so each expert's pairs keep token order: the torch version's rows, in the same order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.moe.routing import ExpertBlocks, max_blocks
from engine.kernels.launch import pdl_launch, pdl_prologue
from engine.kernels.precompile import compile_in_place

CHUNK = 128
CHUNKS_PER_TILE = 64  # chunks the offsets program prefix-sums at once


@triton.jit
def _local_experts(TopkIds, pairs, num_pairs, first_expert, num_local, BLOCK_E: tl.constexpr):
    """The chunk's local expert ids; pairs of other ranks (and past the end) -> BLOCK_E - 1."""
    expert = tl.load(TopkIds + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32) - first_expert
    local = (expert >= 0) & (expert < num_local) & (pairs < num_pairs)
    return tl.where(local, expert, BLOCK_E - 1), local


@triton.jit
def _count_kernel(TopkIds, Counts, num_pairs, first_expert, num_local,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert, _ = _local_experts(TopkIds, pairs, num_pairs, first_expert, num_local, BLOCK_E)
    tl.store(Counts + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(expert, BLOCK_E))


@triton.jit
def _offsets_kernel(Counts, ChunkBase, BlockExpert, num_chunks, num_local, num_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    offs_e = tl.arange(0, BLOCK_E)
    offs_t = tl.arange(0, TILE)
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, TILE):
        rows = c0 + offs_t
        tile = tl.load(Counts + rows[:, None] * BLOCK_E + offs_e[None, :],
                       mask=(rows < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, axis=0)
    totals = tl.where(offs_e < num_local, totals, 0)  # the spare bin gets no rows
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    running = ends - padded  # expert e's next row, chunk by chunk
    for c0 in range(0, num_chunks, TILE):
        rows = c0 + offs_t
        mask = (rows < num_chunks)[:, None]
        tile = tl.load(Counts + rows[:, None] * BLOCK_E + offs_e[None, :], mask=mask, other=0)
        before = tl.cumsum(tile, axis=0) - tile  # this tile's earlier chunks
        tl.store(ChunkBase + rows[:, None] * BLOCK_E + offs_e[None, :], running[None, :] + before,
                 mask=mask)
        running += tl.sum(tile, axis=0)
    for b0 in range(0, num_blocks, TILE):
        blocks = b0 + offs_t
        # the expert whose rows hold the block's first row: how many experts end at or before it
        owner = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(BlockExpert + blocks, tl.where(owner < num_local, owner, -1).to(tl.int64),
                 mask=blocks < num_blocks)


@triton.jit
def _scatter_kernel(TopkIds, ChunkBase, SortedPairs, num_pairs, first_expert, num_local,
                    BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    chunk = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + offs
    expert, local = _local_experts(TopkIds, pairs, num_pairs, first_expert, num_local, BLOCK_E)
    earlier_same = (expert[:, None] == expert[None, :]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    base = tl.load(ChunkBase + chunk * BLOCK_E + expert)
    tl.store(SortedPairs + base + rank, pairs.to(tl.int64), mask=local)


def group_by_expert_kernel(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
                           block_m: int) -> ExpertBlocks:
    """`group_by_expert`'s result (the same rows, in the same order)."""
    num_pairs = topk_ids.numel()
    n_blocks = max_blocks(num_pairs, num_local_experts, block_m)
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    device = topk_ids.device
    ids = topk_ids.contiguous()
    block_e = triton.next_power_of_2(num_local_experts + 1)  # + the other ranks' bin
    counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
    chunk_base = torch.empty_like(counts)
    sorted_pairs = torch.full((n_blocks * block_m,), num_pairs, dtype=torch.long, device=device)
    block_expert = torch.empty(n_blocks, dtype=torch.long, device=device)
    pdl = pdl_launch(device)
    _count_kernel[(num_chunks,)](ids, counts, num_pairs, first_expert, num_local_experts,
                                 BLOCK_E=block_e, CHUNK=CHUNK, num_warps=4, **pdl)
    _offsets_kernel[(1,)](counts, chunk_base, block_expert, num_chunks, num_local_experts, n_blocks,
                          BLOCK_M=block_m, BLOCK_E=block_e, TILE=CHUNKS_PER_TILE, num_warps=8,
                          **pdl)
    _scatter_kernel[(num_chunks,)](ids, chunk_base, sorted_pairs, num_pairs, first_expert,
                                   num_local_experts, BLOCK_E=block_e, CHUNK=CHUNK, num_warps=8,
                                   **pdl)
    return ExpertBlocks(sorted_pairs, block_expert, num_pairs, block_m)


# their rows and offsets index memory (engine/kernels/precompile.py)
compile_in_place(_count_kernel, _offsets_kernel, _scatter_kernel)
