"""MoE experts for decode-sized batches: one matrix-vector product per (token, choice) pair.

At a handful of tokens almost every pair has an expert of its own, so grouping pairs by
expert (`routing.group_by_expert`: a sort and ~15 small kernels) buys nothing and costs
more than the experts' weight reads. Here each pair reads its expert's rows directly:
- `_gate_up_kernel`: program (pair, n-block) computes the gate and up rows of its block
  and writes silu(gate) * up: the SiLU-and-mul is fused;
- `_down_kernel`: program (pair, n-block) writes weight * down(act) for its block; one
  torch sum over each token's choices follows. (Summing the choices inside the kernel left
  too few programs at batch 1: 80 us per layer on the H200 against ~10 us of weights.)
Three launches per layer, shapes fixed by the token count (CUDA-graph capturable). Pairs of
another rank's experts (expert parallelism) give zero rows.

Imported only by the GPU path of `engine.layers.moe` (and under TRITON_INTERPRET=1 by tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.moe.grouped_gemm import choices_or_sum
from engine.kernels.launch import pdl_launch, pdl_prologue
from engine.kernels.split_sums import SplitSums
from engine.kernels.tiles import Tiles

# Up to this many (token, choice) pairs the per-pair path runs. On the H200 (Qwen3-30B-A3B
# shapes, scripts/bench_layer_kernels.py) at 1/4/8 tokens it took 29/78/140 us
# against the grouped GEMMs' 24/71/127 us with their best tiles plus ~10 us of grouping:
# about even, with three launches fewer. At 16 tokens grouping won clearly.
MAX_PAIRS = 64


def tiles_for(tokens: int) -> tuple[Tiles, Tiles]:
    """(gate/up tiles, down tiles) from the sweep on the H200 (scripts/bench_layer_kernels.py,
    Qwen3-30B-A3B shapes): gate/up's fastest at 1 and 4 tokens (at 8, 64 x 128
    tiles were); down's fastest at 1 token, and at 4 and 8."""
    if tokens == 1:
        return Tiles(32, 256, num_stages=4), Tiles(64, 256, num_stages=4)
    return Tiles(32, 256, num_stages=4), Tiles(16, 64, num_stages=2)


# W13/W2 may be float8 (FP8 experts): weights are widened to float32 as they are read and
# the sums scaled by Scale, one float32 per (expert, output row), [E, N] contiguous.
@triton.jit
def _gate_up_kernel(X, W13, TopkIds, Out, inter, K, stride_x, stride_we, stride_wn, stride_o,
                    first_expert, num_local,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    Scale=None, HAS_SCALE: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(TopkIds + pair).to(tl.int64) - first_expert
    if (expert < 0) | (expert >= num_local):
        return  # another rank's expert: the down kernel skips this pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter
    x_ptrs = X + (pair // TOP_K) * stride_x + offs_k
    gate_ptrs = W13 + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_gate += tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    if HAS_SCALE:
        gate = gate * tl.load(Scale + expert * 2 * inter + offs_n, mask=n_mask, other=0.0)
        up = up * tl.load(Scale + expert * 2 * inter + inter + offs_n, mask=n_mask, other=0.0)
    # Rounded where the grouped path rounds: the GEMM's output, then the activation.
    gate = gate.to(Out.dtype.element_ty).to(tl.float32)
    up = up.to(Out.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + pair * stride_o + offs_n, (act * up).to(Out.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_kernel(Act, W2, TopkIds, TopkWeights, Out, N, inter, stride_a, stride_we, stride_wn,
                 stride_o, first_expert, num_local, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 Scale=None, HAS_SCALE: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(TopkIds + pair).to(tl.int64) - first_expert
    local = (expert >= 0) & (expert < num_local)
    expert = tl.where(local, expert, 0)
    k_end = tl.where(local, inter, 0)  # another rank's expert: no loads, the row is zero
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_ptrs = Act + pair * stride_a + offs_k
    w_ptrs = W2 + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * a
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # Rounded as the grouped path rounds: the weighted product, in the model dtype.
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y = y * tl.load(Scale + expert * N + offs_n, mask=n_mask, other=0.0)
    y = y * tl.load(TopkWeights + pair).to(tl.float32)
    tl.store(Out + pair * stride_o + offs_n, y.to(Out.dtype.element_ty), mask=n_mask)


def experts_per_pair(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int = 0,
                     config: Tiles | None = None, down_config: Tiles | None = None,
                     keep_choices: bool = False, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None) -> torch.Tensor | SplitSums:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), local experts only:
    `moe.experts_torch`'s result, for batches of at most a few tokens. With `keep_choices`
    the k weighted outputs come back unsummed, for the next RMSNorm to add. Float8 weights
    come with their per-row scales ([E, N, 1])."""
    t, top_k = topk_ids.shape
    default_gate_up, default_down = tiles_for(t)
    config, down_config = config or default_gate_up, down_config or default_down
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    ids = topk_ids.contiguous()
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(t * top_k, triton.cdiv(inter, config.block_n))](
        x, w13, ids, act, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        first_expert, num_local, TOP_K=top_k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        Scale=w13_scale, HAS_SCALE=w13_scale is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x.device))
    out = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(t * top_k, triton.cdiv(hidden, down_config.block_n))](
        act, w2, ids, topk_weights.contiguous(), out, hidden, inter, act.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), first_expert, num_local,
        BLOCK_N=down_config.block_n, BLOCK_K=down_config.block_k,
        Scale=w2_scale, HAS_SCALE=w2_scale is not None,
        num_warps=down_config.num_warps, num_stages=down_config.num_stages,
        **pdl_launch(x.device))
    return choices_or_sum(out, top_k, keep_choices)
