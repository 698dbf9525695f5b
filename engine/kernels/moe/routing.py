"""Mixture-of-experts routing: the token order the grouped GEMM reads the (token, choice)
pairs in (which experts each token goes to: `select_experts` in engine/kernels/moe/router.py).

Every function here is plain torch with shapes fixed by the number of tokens alone (no
`.item()`, no data-dependent sizes), so the GPU path can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertBlocks:
    """(token, choice) pairs grouped by expert into blocks of `block_m` rows.

    Pair p is token p // top_k's choice p % top_k. Each expert's pairs fill whole blocks,
    padded with the sentinel `num_pairs`; block b belongs to expert `block_expert[b]`
    (a local index), or to none (-1: unused block, or experts of another rank).
    """

    sorted_pairs: torch.Tensor  # int64 [num_blocks * block_m]
    block_expert: torch.Tensor  # int64 [num_blocks]
    num_pairs: int
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    # Each expert in use wastes < block_m rows of padding; at most min(E, pairs) are in use.
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return max(1, -(-padded // block_m))


def group_by_expert(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
                    block_m: int) -> ExpertBlocks:
    """Sort the pairs of `topk_ids` [T, k] by expert into block-aligned runs.

    Only experts [first_expert, first_expert + num_local_experts) are this rank's (expert
    parallelism); pairs routed elsewhere get no block. A stable sort keeps each expert's
    pairs in token order.
    """
    device, e_local = topk_ids.device, num_local_experts
    local = topk_ids.flatten().long() - first_expert
    num_pairs = local.numel()
    # Bucket e_local collects the pairs of other ranks' experts.
    bucket = torch.where((local >= 0) & (local < e_local), local, e_local)
    counts = torch.zeros(e_local + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:e_local] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    n_blocks = max_blocks(num_pairs, e_local, block_m)
    capacity = n_blocks * block_m
    # Start row of each bucket; the foreign bucket writes to a scratch row past the end.
    starts = torch.cat([ends - padded, torch.full((1,), capacity, device=device)])  # no host copy
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first_of_bucket = torch.cumsum(counts, 0) - counts
    rank_in_bucket = torch.arange(num_pairs, device=device) - first_of_bucket[sorted_bucket]
    dest = torch.where(sorted_bucket < e_local, starts[sorted_bucket] + rank_in_bucket, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.long, device=device)
    sorted_pairs.scatter_(0, dest, order)
    block_start = torch.arange(n_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < e_local, block_expert, -1)
    return ExpertBlocks(sorted_pairs[:capacity], block_expert, num_pairs, block_m)
