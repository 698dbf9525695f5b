"""Which experts each token goes to (`select_experts`: softmax, then top-k), on the GPU as one
Triton kernel (`softmax_topk`; also runs under TRITON_INTERPRET=1).

The torch version is six launches (cast, softmax, top-k, sum, divide, and the int64 ids),
each a few microseconds on a decode step where the whole MoE layer has ~30 us of weights to
read. Here one program per token does the softmax in float32 and picks the top k by k
arg-max passes over the row (k <= 8-ish, experts <= 512: all in registers).

Ties between equal probabilities pick the lowest expert id; torch.topk leaves that order
unspecified.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.inline import add_split_sums
from engine.kernels.launch import pdl_launch, pdl_prologue
from engine.kernels.split_sums import SplitSums
from engine.kernels.precompile import compile_in_place


@triton.jit
def _softmax_topk_kernel(Logits, Weights, Ids, num_experts, stride_l, stride_split,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                         SPLITS: tl.constexpr = 0, DTYPE: tl.constexpr = tl.float32,
                         PDL: tl.constexpr = False):
    """SPLITS > 0: Logits are the router GEMV's float32 K-slice partial sums, added here and
    rounded to the router's output dtype DTYPE (engine/kernels/split_sums.py)."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    logits = add_split_sums(Logits + token * stride_l + offs_e, e_mask, stride_split, SPLITS, DTYPE)
    logits = tl.where(e_mask, logits.to(tl.float32), -float("inf"))
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    offs_k = tl.arange(0, BLOCK_TOPK)
    weights = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int64)
    remaining = tl.where(offs_e < num_experts, probs, -1.0)
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        # the lowest index holding the maximum
        best_id = tl.min(tl.where(remaining == best, offs_e, BLOCK_E), axis=0)
        # NaN logits match nothing: an id past the experts would address another's weights
        best_id = tl.minimum(best_id, num_experts - 1)
        weights = tl.where(offs_k == k, best, weights)
        ids = tl.where(offs_k == k, best_id.to(tl.int64), ids)
        remaining = tl.where(offs_e == best_id, -1.0, remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    k_mask = offs_k < TOP_K
    tl.store(Weights + token * TOP_K + offs_k, weights, mask=k_mask)
    tl.store(Ids + token * TOP_K + offs_k, ids, mask=k_mask)


def select_experts(router_logits: torch.Tensor | SplitSums, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32, as HF), then the top_k per token.

    With `renormalize` the chosen probabilities are rescaled to sum to 1 (Mixtral always,
    Qwen MoE when `norm_topk_prob`). Returns (weights float32 [T, k], expert ids int64 [T, k]).
    """
    if router_logits.is_cuda:  # one launch instead of six (`softmax_topk`)
        if isinstance(router_logits, SplitSums):  # the router GEMV's slices, added in the launch
            return softmax_topk(router_logits, top_k, renormalize)
        return softmax_topk(router_logits.contiguous(), top_k, renormalize)
    if isinstance(router_logits, SplitSums):
        router_logits = router_logits.total()
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def softmax_topk(router_logits: torch.Tensor | SplitSums, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]), as `select_experts`; the logits
    may be the router GEMV's partial sums."""
    splits, stride_split, dtype = 0, 0, tl.float32
    if isinstance(router_logits, SplitSums):
        splits, stride_split = router_logits.splits, router_logits.parts.stride(0)
        dtype = _TL_DTYPES[router_logits.dtype]
        router_logits = router_logits.parts[0]
    t, num_experts = router_logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t:
        _softmax_topk_kernel[(t,)](router_logits, weights, ids, num_experts,
                                   router_logits.stride(0), stride_split, TOP_K=top_k,
                                   RENORMALIZE=renormalize,
                                   BLOCK_E=triton.next_power_of_2(num_experts),
                                   BLOCK_TOPK=triton.next_power_of_2(top_k), SPLITS=splits,
                                   DTYPE=dtype, num_warps=4, **pdl_launch(router_logits.device))
    return weights, ids


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


compile_in_place(_softmax_topk_kernel)  # its expert ids index weights (engine/kernels/precompile.py)
