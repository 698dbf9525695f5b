"""A fused mixture-of-experts layer: all experts' SwiGLU MLPs as two stacked weights.

`w13` [E_local, 2 * I_local, H] holds each expert's gate rows then up rows; `w2`
[E_local, H, I_local] its down projection. Across tensor-parallel ranks the experts are
either
- "tp": sharded like a dense MLP (every rank holds every expert, a 1/tp slice of its
  intermediate width), or
- "ep": split whole (rank r holds experts [r * E/tp, (r+1) * E/tp)).
Either way every rank sees every token (the hidden states are replicated between layers),
computes a partial sum of the output (over its slice of the width, or over its experts),
and the owner of the layer adds the ranks' partial sums with one all-reduce.

The forward has two implementations of the same computation:
- CPU (reference): pairs sorted by expert, one matmul per expert in use.
- GPU: pairs grouped into expert blocks (`moe_align_kernel`, three launches), then two Triton
  grouped GEMMs (`moe_kernels.grouped_gemm`) around SiLU-and-mul: no Python loop over
  experts, no host sync, shapes fixed by the token count (CUDA-graph capturable).
  Decode-sized batches skip the grouping: one matrix-vector product per (token, choice)
  pair (`moe_pair_kernels`).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.parallel import Loadable, TPContext, copy_into, divide, narrow
from engine.kernels.split_sums import SplitSums

MoEParallel = Literal["tp", "ep"]
MOE_PARALLEL_MODES = ("tp", "ep")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    """Expert e's matrix of a stacked weight, dequantized to `dtype` when it is float8 (one
    scale per output row, `scale` [E, N, 1])."""
    if scale is None:
        return w[e]
    from engine.quantization.fp8 import dequantize

    return dequantize(w[e], scale[e], dtype)


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), local experts only.

    x [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; topk_* [T, k]. The reference (and
    the CPU path): reads the per-expert counts on the host and loops over experts in use.
    Float8 weights (FP8) come with per-row scales and are dequantized expert by expert.
    """
    t, k = topk_ids.shape
    local = topk_ids.flatten() - first_expert
    num_local = w13.shape[0]
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local.clamp(-1, num_local) + 1, minlength=num_local + 2).tolist()
    out = x.new_zeros(t * k, w2.shape[1])
    start = counts[0]  # pairs of experts before ours (another rank's)
    for e, n in enumerate(counts[1:num_local + 1]):
        if n:
            pairs = order[start:start + n]
            gate_up = F.linear(x[pairs // k], expert_weight(w13, w13_scale, e, x.dtype))
            out[pairs] = F.linear(silu_and_mul(gate_up), expert_weight(w2, w2_scale, e, x.dtype))
            start += n
    out = (out.float() * topk_weights.flatten()[:, None].float()).to(out.dtype)  # fp32, as HF
    return out.view(t, k, w2.shape[1]).sum(dim=1)


def block_rows(num_pairs: int, num_local_experts: int) -> int:
    """Rows per expert block: about one block per expert in use (fewer padded rows at
    decode sizes, fewer weight re-reads at prefill sizes)."""
    per_expert = num_pairs / num_local_experts
    return 16 if per_expert <= 8 else 32 if per_expert <= 24 else 64 if per_expert <= 64 else 128


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, first_expert: int = 0,
                   keep_choices: bool = False, w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None) -> torch.Tensor | SplitSums:
    """The same as `experts_torch` in Triton (GPU, or TRITON_INTERPRET=1): per-pair products
    for decode-sized batches, two grouped GEMMs over expert blocks above. With
    `keep_choices` each token's k weighted outputs may come back unsummed (a SplitSums).
    Float8 weights are read as they are and scaled per output row (W8A16)."""
    from engine.kernels.fused import silu_and_mul as silu_and_mul_kernel
    from engine.kernels.moe.align import group_by_expert_kernel
    from engine.kernels.moe.grouped_gemm import choices_or_sum, grouped_gemm, tiles_for
    from engine.kernels.moe.pairs import MAX_PAIRS, experts_per_pair

    t, k = topk_ids.shape
    num_pairs = t * k
    if num_pairs <= MAX_PAIRS:
        return experts_per_pair(x, w13, w2, topk_weights, topk_ids, first_expert,
                                keep_choices=keep_choices, w13_scale=w13_scale,
                                w2_scale=w2_scale)
    block_m = block_rows(num_pairs, w13.shape[0])
    blocks = group_by_expert_kernel(topk_ids, w13.shape[0], first_expert, block_m)
    gate_up_tiles, down_tiles = tiles_for(block_m)
    gate_up = torch.empty((num_pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, blocks, gate_up, rows_per_a=k, config=gate_up_tiles, w_scale=w13_scale)
    act = silu_and_mul_kernel(gate_up)
    # Pairs of other ranks' experts are not written: their rows must read as zero.
    out = torch.zeros((num_pairs, w2.shape[1]), dtype=x.dtype, device=x.device)
    grouped_gemm(act, w2, blocks, out, rows_per_a=1,
                 pair_weights=topk_weights.flatten().float().contiguous(), config=down_tiles,
                 w_scale=w2_scale)
    return choices_or_sum(out, k, keep_choices)


class FusedMoE(nn.Module):
    """The routed experts of one layer. `forward(x, topk_weights, topk_ids)` returns this
    rank's partial sum (all-reduce it across ranks unless `reduce_results`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TPContext | None = None, parallel: MoEParallel = "tp",
                 reduce_results: bool = True) -> None:
        super().__init__()
        if parallel not in MOE_PARALLEL_MODES:
            raise ValueError(f"moe_parallel must be one of {MOE_PARALLEL_MODES}, got {parallel!r}")
        self.tp = tp or TPContext()
        self.parallel = parallel
        self.num_experts = num_experts
        self.reduce_results = reduce_results
        if parallel == "ep":
            self.num_local_experts = divide(num_experts, self.tp.size, "number of experts")
            self.intermediate_per_rank = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_per_rank = divide(intermediate_size, self.tp.size,
                                                "MoE intermediate size")
        self.first_expert = self.tp.rank * self.num_local_experts if parallel == "ep" else 0
        e, i = self.num_local_experts, self.intermediate_per_rank
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        # FP8 (`quantize_fp8_`): float8 w13/w2 with one scale per output row, [E, N, 1]
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)

    @torch.no_grad()
    def quantize_fp8_(self) -> None:
        """Loaded weights -> float8 with one scale per output row of each expert (FP8 weights
        quantized at load, `EngineConfig(quantization="fp8")`); activations stay in the model
        dtype (W8A16): half the bytes a decode step reads."""
        from engine.quantization.fp8 import quantize_rows

        for name in ("w13", "w2"):
            w = getattr(self, name)
            q, scale = quantize_rows(w.data.reshape(-1, w.shape[-1]))
            setattr(self, name, nn.Parameter(q.view(w.shape), requires_grad=False))
            setattr(self, f"{name}_scale",
                    nn.Parameter(scale.view(w.shape[0], w.shape[1], 1), requires_grad=False))

    def is_local(self, expert_id: int) -> bool:
        return 0 <= expert_id - self.first_expert < self.num_local_experts

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, expert_id: int, shard: str) -> None:
        """Copy checkpoint expert `expert_id`'s `shard` ("gate", "up" or "down", each a
        plain [out, in] matrix) into this rank's slice; experts of other ranks are skipped
        unread."""
        if not self.is_local(expert_id):
            return
        e, i = expert_id - self.first_expert, self.intermediate_per_rank
        start = self.tp.rank * i if self.parallel == "tp" else 0
        if shard == "down":
            copy_into(param[e], narrow(loaded, 1, start, i))
        elif shard in ("gate", "up"):
            offset = 0 if shard == "gate" else i
            copy_into(param[e].narrow(0, offset, i), narrow(loaded, 0, start, i))
        else:
            raise ValueError(f"unknown expert shard {shard!r}")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                keep_choices: bool = False) -> torch.Tensor | SplitSums:
        """This rank's experts' output; with `keep_choices` (tp size 1 only) possibly each
        token's choices unsummed, for an RMSNorm to add (engine/kernels/split_sums.py)."""
        scales = dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        if not x.is_cuda:
            out = experts_torch(x, self.w13, self.w2, topk_weights, topk_ids, self.first_expert,
                                **scales)
        else:
            out = experts_triton(x, self.w13, self.w2, topk_weights, topk_ids, self.first_expert,
                                 keep_choices=keep_choices and self.tp.size == 1, **scales)
        if self.reduce_results and self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return out
