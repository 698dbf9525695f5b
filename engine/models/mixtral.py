"""Mixtral (MixtralForCausalLM): every layer's MLP is a sparse MoE block of
`num_local_experts` experts, top `num_experts_per_tok` of a softmax, renormalised."""
from __future__ import annotations

from typing import Any

from engine.models.moe import MoEForCausalLM, SparseMoeBlock, sliding_window_error


class MixtralForCausalLM(MoEForCausalLM):
    def check_supported(self, hf_config: Any) -> None:
        if getattr(hf_config, "sliding_window", None):
            raise sliding_window_error(f"sliding_window={hf_config.sliding_window}")

    def make_moe_block(self) -> SparseMoeBlock:
        cfg = self.config
        return SparseMoeBlock(cfg, self.tp, self.moe_parallel, renormalize=True,
                              moe_intermediate_size=cfg.intermediate_size)
