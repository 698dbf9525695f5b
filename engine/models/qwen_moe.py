"""Qwen2-MoE and Qwen3-MoE.

Both: MoE blocks in the layers picked by `decoder_sparse_step` and not in `mlp_only_layers`
(the others keep a dense MLP of `intermediate_size`), experts of `moe_intermediate_size`,
softmax top-k renormalised only when `norm_topk_prob`.
Qwen2-MoE adds a shared expert (`shared_expert_intermediate_size`) scaled by
sigmoid(`shared_expert_gate`(x)), and q/k/v biases (`qkv_bias`); Qwen3-MoE has neither, but
per-head q/k RMSNorm (handled by the Llama attention, as for Qwen3).
"""
from __future__ import annotations

from engine.models.moe import MoEForCausalLM, SparseMoeBlock


class Qwen2MoeForCausalLM(MoEForCausalLM):
    def is_sparse_layer(self, layer_id: int) -> bool:
        cfg = self.config
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return (layer_id not in (getattr(cfg, "mlp_only_layers", None) or [])
                and cfg.num_experts > 0 and (layer_id + 1) % step == 0)

    def shared_intermediate_size(self) -> int:
        return self.config.shared_expert_intermediate_size

    def make_moe_block(self) -> SparseMoeBlock:
        cfg = self.config
        return SparseMoeBlock(cfg, self.tp, self.moe_parallel, renormalize=bool(cfg.norm_topk_prob),
                              moe_intermediate_size=cfg.moe_intermediate_size,
                              shared_intermediate_size=self.shared_intermediate_size())


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    def shared_intermediate_size(self) -> int:
        return 0  # no shared expert
