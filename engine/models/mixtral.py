"""Mixtral (MixtralForCausalLM): every layer's MLP is a sparse MoE block of
`num_local_experts` experts, top `num_experts_per_tok` of a softmax, renormalised."""
from __future__ import annotations

from engine.models.moe import MoEForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoEForCausalLM):
    def make_moe_block(self) -> SparseMoeBlock:
        cfg = self.config
        return SparseMoeBlock(cfg, self.tp, self.moe_parallel, renormalize=True,
                              moe_intermediate_size=cfg.intermediate_size)
