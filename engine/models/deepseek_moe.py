"""DeepSeek-V2/V3's MoE block: a float32 router with grouped top-k, the routed experts on the
shared fused-MoE path (engine/layers/moe.py) and always-on shared experts.

Routing, as transformers and the reference code do it:
- V2: softmax scores; `topk_method="group_limited_greedy"` first keeps the `topk_group`
  expert groups (of `n_group`) whose best expert scores highest, then takes the top k
  experts inside them ("greedy": top k over all experts).
- V3 (`noaux_tc`): sigmoid scores; the choice adds `e_score_correction_bias` and ranks the
  groups by the sum of their two best experts, but the weights are the plain scores.
Both: weights renormalised to sum to 1 when `norm_topk_prob`, then multiplied by
`routed_scaling_factor`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.split_sums import SplitSums
from engine.layers.moe import FusedMoE, MoEParallel
from engine.layers.parallel import TPContext
from engine.models.llama import LlamaMLP


def grouped_topk(scores: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """Expert ids [T, top_k] chosen from `scores` [T, E] (float32) within the best
    `topk_group` groups; with `bias` (V3) groups are ranked by their two best biased scores
    and masked experts can never be chosen, without (V2) by their best score."""
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = (grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None
                        else grouped.max(dim=-1).values)
        keep = torch.zeros_like(group_scores)
        keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1)[1], 1.0)
        keep = keep.bool().unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(~keep, float("-inf") if bias is not None else 0.0)
    return torch.topk(choice, top_k, dim=-1)[1]


class DeepseekRouter(nn.Module):
    """The gate: float32 logits (the weight kept in float32, as transformers keeps it),
    then (weights float32 [T, k], ids int64 [T, k])."""

    def __init__(self, hf_config: Any, num_experts: int, v3: bool) -> None:
        super().__init__()
        self.top_k = hf_config.num_experts_per_tok
        self.v3 = v3
        grouped = v3 or getattr(hf_config, "topk_method", "greedy") == "group_limited_greedy"
        self.n_group = (getattr(hf_config, "n_group", None) or 1) if grouped else 1
        self.topk_group = getattr(hf_config, "topk_group", None) or self.n_group
        self.renormalize = bool(getattr(hf_config, "norm_topk_prob", False)) and self.top_k > 1
        self.scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        method = getattr(hf_config, "topk_method", None)
        if not v3 and method not in (None, "greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported DeepSeek-V2 topk_method {method!r}")
        self.weight = nn.Parameter(torch.empty(num_experts, hf_config.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        if v3:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        scores = logits.sigmoid() if self.v3 else logits.softmax(dim=-1)
        ids = grouped_topk(scores, self.top_k, self.n_group, self.topk_group,
                           self.e_score_correction_bias)
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekMoE(nn.Module):
    """Routed experts plus `n_shared_experts` shared ones (one MLP of that many times the
    expert width); both partial sums are added before the layer's one all-reduce."""

    def __init__(self, hf_config: Any, tp: TPContext, parallel: MoEParallel, num_experts: int,
                 v3: bool) -> None:
        super().__init__()
        self.tp = tp
        inter = hf_config.moe_intermediate_size
        self.gate = DeepseekRouter(hf_config, num_experts, v3)
        self.experts = FusedMoE(num_experts, hf_config.hidden_size, inter, tp, parallel,
                                reduce_results=False)
        shared = getattr(hf_config, "n_shared_experts", None) or 0
        self.shared_experts = (LlamaMLP(hf_config, tp, inter * shared, reduce_results=False)
                               if shared else None)
        self.split_sums_ok = False  # set by the decoder layer; this block always sums

    def forward(self, x: torch.Tensor | SplitSums) -> torch.Tensor:
        if isinstance(x, SplitSums):
            x = x.total()
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if isinstance(out, SplitSums):
            out = out.total()
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            out = out + (shared.total() if isinstance(shared, SplitSums) else shared)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out
