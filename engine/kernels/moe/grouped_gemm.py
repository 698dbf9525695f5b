"""Triton grouped GEMM for mixture-of-experts layers (GPU; also runs under TRITON_INTERPRET=1).

One launch multiplies every expert's tokens by that expert's weight: program (b, n) takes
block b of the expert-sorted pairs (`ExpertBlocks`), reads the block's expert id, gathers
its rows of A and computes their [block_m, block_n] output tile against W[expert]. The grid
is sized by the number of tokens alone; blocks nobody uses exit at once, so a step's launch
is the same whatever the routing (CUDA-graph capturable).

Imported only by the GPU path of `engine.layers.moe`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.moe.routing import ExpertBlocks
from engine.kernels.launch import pdl_launch, pdl_prologue, split_sums_on
from engine.kernels.split_sums import SplitSums
from engine.kernels.tiles import Tiles


# num_pairs (tokens x top-k) changes every step and is only compared against: not
# specialised (== 1 / divisible by 16 would each compile another binary).
# W may be float8 (FP8 experts): each tile is converted to A's dtype for the dot and the
# output scaled by Scale, one float32 per (expert, output row), [E, N] contiguous.
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(A, W, C, SortedPairs, BlockExpert, PairWeights, num_pairs, N, K,
                         stride_am, stride_we, stride_wn, stride_cm,
                         ROWS_PER_A: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         Scale=None, HAS_SCALE: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m)
    if expert < 0:
        return
    pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // ROWS_PER_A  # A is per token (first GEMM, gathered) or per pair (second)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        acc = acc * tl.load(Scale + expert * N + offs_n, mask=n_mask, other=0.0)[None, :]
    if WEIGHTED:  # the router's weight of each pair, applied before rounding (fp32 accumulator)
        acc = acc * tl.load(PairWeights + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = C + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def tiles_for(block_m: int) -> tuple[Tiles, Tiles]:
    """(gate/up tiles, down tiles) for expert blocks of `block_m` rows: the sweep's fastest on
    the H200 at the batch sizes that pick each block size (scripts/bench_layer_kernels.py,
    Qwen3-30B-A3B shapes)."""
    if block_m <= 16:
        return Tiles(64, 128, num_stages=4), Tiles(64, 128)
    if block_m <= 32:
        return Tiles(128, 128), Tiles(64, 128)
    if block_m <= 64:
        return Tiles(128, 64), Tiles(128, 64)
    return Tiles(128, 64), Tiles(128, 64, num_warps=8)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, blocks: ExpertBlocks, out: torch.Tensor,
                 rows_per_a: int, pair_weights: torch.Tensor | None = None,
                 config: Tiles = Tiles(128, 64), w_scale: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """out[p] = a[p // rows_per_a] @ w[expert(p)].T (times pair_weights[p]) for every pair p
    of a local expert; rows of other pairs are left as they are.

    a [rows, K] (unit last stride), w [E, N, K] contiguous, out [num_pairs, N]; float8 w
    comes with `w_scale` [E, N, 1] (float32, one per output row).
    """
    n, k = w.shape[1], w.shape[2]
    block_n = min(config.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    grid = (blocks.block_expert.numel(), triton.cdiv(n, block_n))
    weights = pair_weights if pair_weights is not None else out  # unread unless WEIGHTED
    _grouped_gemm_kernel[grid](a, w, out, blocks.sorted_pairs, blocks.block_expert, weights,
                               blocks.num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1),
                               out.stride(0), ROWS_PER_A=rows_per_a,
                               WEIGHTED=pair_weights is not None,
                               # float32 models get float32 products, not TF32's 10-bit mantissa
                               PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                               BLOCK_M=blocks.block_m,
                               BLOCK_N=block_n, BLOCK_K=block_k, Scale=w_scale,
                               HAS_SCALE=w_scale is not None, num_warps=config.num_warps,
                               num_stages=config.num_stages, **pdl_launch(a.device))
    return out


@triton.jit
def _sum_choices_kernel(PerPair, Out, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in tl.static_range(TOP_K):
        acc += tl.load(PerPair + (token * TOP_K + c) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + token * hidden + offs, acc.to(Out.dtype.element_ty), mask=mask)


def sum_choices(per_pair: torch.Tensor, top_k: int) -> torch.Tensor:
    """[tokens * top_k, hidden] (contiguous, a token's choices adjacent) -> [tokens, hidden]:
    each token's weighted expert outputs added up in float32, rounded once. One launch; torch's
    `.view(t, k, h).sum(1)` took 4.8 us at one token on the H200, a third of an expert GEMV."""
    pairs, hidden = per_pair.shape
    out = torch.empty((pairs // top_k, hidden), dtype=per_pair.dtype, device=per_pair.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if pairs:
        _sum_choices_kernel[(pairs // top_k, triton.cdiv(hidden, block))](
            per_pair, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4,
            **pdl_launch(per_pair.device))
    return out


def choices_or_sum(per_pair: torch.Tensor, top_k: int, keep: bool) -> torch.Tensor | SplitSums:
    """`sum_choices`, or with `keep` the choices unsummed ([top_k, tokens, hidden] views) for
    a consumer that adds them as `sum_choices` would (engine/kernels/split_sums.py)."""
    if not (keep and split_sums_on()):
        return sum_choices(per_pair, top_k)
    tokens = per_pair.shape[0] // top_k
    return SplitSums(per_pair.view(tokens, top_k, -1).transpose(0, 1), per_pair.dtype)
