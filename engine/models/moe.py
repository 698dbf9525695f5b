"""The mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE, and what they share.

They are Llama-family decoders whose MLP is, in some or all layers, a sparse MoE block:
a router picks `num_experts_per_tok` experts per token, the experts' outputs are summed
weighted by the router's probabilities, and (Qwen2-MoE) a shared expert, scaled by a
sigmoid gate, is added. Attention, norms, embeddings and the loading of everything but the
experts are `LlamaForCausalLM`'s.

Checkpoints store one [out, in] matrix per expert and projection, named
`...layers.L.{mlp|block_sparse_moe}.experts.E.{gate_proj|w1, up_proj|w3, down_proj|w2}.weight`;
`load_weights` copies each into its expert's slice of the stacked `w13` / `w2`.

Mixtral (MixtralForCausalLM): every layer's MLP is a sparse MoE block of
`num_local_experts` experts, top `num_experts_per_tok` of a softmax, renormalised.

Qwen2-MoE and Qwen3-MoE: MoE blocks in the layers picked by `decoder_sparse_step` and not
in `mlp_only_layers` (the others keep a dense MLP of `intermediate_size`), experts of
`moe_intermediate_size`, softmax top-k renormalised only when `norm_topk_prob`.
Qwen2-MoE adds a shared expert (`shared_expert_intermediate_size`) scaled by
sigmoid(`shared_expert_gate`(x)), and q/k/v biases (`qkv_bias`); Qwen3-MoE has neither, but
per-head q/k RMSNorm (handled by the Llama attention, as for Qwen3).
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.layers.linear import ReplicatedLinear
from engine.layers.moe import FusedMoE, MoEParallel
from engine.kernels.moe.router import select_experts
from engine.layers.parallel import Loadable, TPContext
from engine.kernels.split_sums import SplitSums
from engine.models.llama import LlamaForCausalLM, LlamaMLP

_EXPERT_WEIGHT = re.compile(
    r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_SHARD = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
          "down_proj": "down"}


class SparseMoeBlock(nn.Module):
    """Router, routed experts and an optional sigmoid-gated shared expert. The experts' and
    the shared expert's partial sums are added before the layer's one all-reduce."""

    def __init__(self, hf_config: Any, tp: TPContext, parallel: MoEParallel, renormalize: bool,
                 moe_intermediate_size: int, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = hf_config.num_experts_per_tok
        self.renormalize = renormalize
        hidden, num_experts = hf_config.hidden_size, hf_config.num_experts
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, tp=tp)
        self.gate.split_sums_ok = True  # the router kernel adds a GEMV's partial sums
        self.gate.keep_dtype = True  # FP8 models keep the router in the model dtype
        # Set by the decoder layer: its output goes only to an RMSNorm, which can add each
        # token's expert outputs itself (engine/kernels/split_sums.py).
        self.split_sums_ok = False
        self.experts = FusedMoE(num_experts, hidden, moe_intermediate_size, tp, parallel,
                                reduce_results=False)
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(hf_config, tp, shared_intermediate_size,
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, tp=tp)
            self.shared_expert_gate.keep_dtype = True

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        keep = self.split_sums_ok and self.shared_expert is None and self.tp.size == 1
        out = self.experts(x, topk_weights, topk_ids, keep_choices=keep)
        if self.shared_expert is not None:
            # The gate is per token, so it scales each rank's partial sum alike.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder with sparse MoE blocks; subclasses say where and how."""

    def __init__(self, hf_config: Any, attn_backend=None, tp: TPContext | None = None,
                 moe_parallel: MoEParallel = "tp") -> None:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r} (only silu)")
        self.moe_parallel = moe_parallel  # read by make_mlp during the base class's build
        super().__init__(hf_config, attn_backend, tp)

    # -- what subclasses define ---------------------------------------------------------------

    def is_sparse_layer(self, layer_id: int) -> bool:
        return True

    def make_moe_block(self) -> SparseMoeBlock:
        raise NotImplementedError

    def num_routed_experts(self) -> int:
        return self.config.num_experts

    # -- building and loading -----------------------------------------------------------------

    def make_mlp(self, layer_id: int) -> nn.Module | None:
        return self.make_moe_block() if self.is_sparse_layer(layer_id) else None

    def load_weights(self, weights: Iterable[tuple[str, Loadable]]) -> set[str]:
        """Experts' matrices go into the stacked expert weights (this rank's experts or
        slices only); everything else to `LlamaForCausalLM.load_weights`."""
        params = dict(self.named_parameters())
        seen: dict[str, set] = defaultdict(set)

        def dense_weights() -> Iterator[tuple[str, Loadable]]:
            for name, loaded in weights:
                match = _EXPERT_WEIGHT.match(name)
                if match is None:
                    yield name.replace(".block_sparse_moe.", ".mlp."), loaded
                    continue
                prefix, expert, shard = match.group(1), int(match.group(2)), _SHARD[match.group(3)]
                target = f"{prefix}.mlp.experts.{'w2' if shard == 'down' else 'w13'}"
                param = params.get(target)
                if param is None or not 0 <= expert < self.num_routed_experts():
                    raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
                param.weight_loader(param, loaded, expert, shard)
                seen[target].add((expert, shard))

        loaded_names = super().load_weights(dense_weights())
        for target, shards in seen.items():
            experts: FusedMoE = self.get_submodule(target.rsplit(".", 1)[0])
            wanted = {(e, s) for e in range(self.num_routed_experts()) if experts.is_local(e)
                      for s in (("down",) if target.endswith("w2") else ("gate", "up"))}
            if wanted <= shards:
                loaded_names.add(target)
        return loaded_names


class MixtralForCausalLM(MoEForCausalLM):
    def make_moe_block(self) -> SparseMoeBlock:
        cfg = self.config
        return SparseMoeBlock(cfg, self.tp, self.moe_parallel, renormalize=True,
                              moe_intermediate_size=cfg.intermediate_size)


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
