"""`moe_routing.group_by_expert` as one Triton launch (GPU; also runs under TRITON_INTERPRET=1).

The torch version is ~15 small kernels (~90 us per MoE layer on the H200 at 64-480 tokens:
more than a third of the layer's weight-read time). Here a single program does it in four
passes over the pairs, CHUNK at a time:
1. fill the sorted-pairs buffer with the padding sentinel;
2. count the pairs of each local expert (a histogram; other ranks' experts fall in a spare bin);
3. scatter each pair to its expert's next free row: the row base of its expert (a prefix sum
   of the block-padded counts) plus the pair's rank among the chunk's pairs of the same
   expert, so each expert's pairs stay in token order (the torch version's stable sort);
4. label each block with the expert whose rows it holds (-1: none).
One program is serial, so very large batches (long prefills) keep the torch version.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.moe_routing import ExpertBlocks, max_blocks

# Above this many pairs the torch version is faster than one serial program (H200: 80 vs
# 96 us at 2,048 pairs, 147 vs 103 us at 3,840: scripts/bench_layer_kernels.py).
MAX_PAIRS = 2048
CHUNK = 128


@triton.jit
def _align_kernel(TopkIds, SortedPairs, BlockExpert, Cursor, num_pairs, first_expert, num_local,
                  num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, CHUNK)
    capacity = num_blocks * BLOCK_M
    for start in range(0, capacity, CHUNK):
        rows = start + offs_c
        tl.store(SortedPairs + rows, tl.zeros((CHUNK,), dtype=tl.int64) + num_pairs,
                 mask=rows < capacity)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + offs_c
        expert = tl.load(TopkIds + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32) - first_expert
        local = (expert >= 0) & (expert < num_local) & (pairs < num_pairs)
        counts += tl.histogram(tl.where(local, expert, BLOCK_E - 1), BLOCK_E)
    counts = tl.where(offs_e < num_local, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    cursor = ends - padded  # each expert's next free row
    tl.store(Cursor + offs_e, cursor)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        pairs = start + offs_c
        expert = tl.load(TopkIds + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32) - first_expert
        local = (expert >= 0) & (expert < num_local) & (pairs < num_pairs)
        expert = tl.where(local, expert, BLOCK_E - 1)
        earlier_same = (expert[:, None] == expert[None, :]) & (offs_c[None, :] < offs_c[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        base = tl.load(Cursor + expert)
        tl.store(SortedPairs + base + rank, pairs.to(tl.int64), mask=local)
        tl.debug_barrier()  # every base read before the cursor moves on
        cursor += tl.histogram(expert, BLOCK_E)
        tl.store(Cursor + offs_e, cursor)
        tl.debug_barrier()
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + offs_c
        # the expert whose rows hold the block's first row: how many experts end at or before it
        owner = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(BlockExpert + blocks, tl.where(owner < num_local, owner, -1).to(tl.int64),
                 mask=blocks < num_blocks)


def group_by_expert_kernel(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
                           block_m: int) -> ExpertBlocks:
    """`group_by_expert`'s result (the same rows, in the same order) in one launch."""
    num_pairs = topk_ids.numel()
    n_blocks = max_blocks(num_pairs, num_local_experts, block_m)
    device = topk_ids.device
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.long, device=device)
    block_expert = torch.empty(n_blocks, dtype=torch.long, device=device)
    block_e = triton.next_power_of_2(num_local_experts + 1)  # + the other ranks' bin
    cursor = torch.empty(block_e, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids.contiguous(), sorted_pairs, block_expert, cursor, num_pairs,
                        first_expert, num_local_experts, n_blocks, BLOCK_M=block_m,
                        BLOCK_E=block_e, CHUNK=CHUNK, num_warps=8)
    return ExpertBlocks(sorted_pairs, block_expert, num_pairs, block_m)
