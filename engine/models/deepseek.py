"""DeepSeek-V2, V2-Lite and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`).

Llama's decoder shape (pre-norm, residual carried apart) with:
- multi-head latent attention (engine/models/mla.py) over a latent KV pool
  (engine/attention/mla_backend.py); V2-Lite has no query LoRA (`q_lora_rank` None);
- the first `first_k_dense_replace` layers dense (SwiGLU of `intermediate_size`), the rest
  MoE with shared experts and grouped top-k routing (engine/models/deepseek_moe.py);
- experts split across TP ranks by width ("tp") or whole ("ep"), as the other MoE models.
A V3 checkpoint's multi-token-prediction layers (index >= num_hidden_layers) are skipped.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import LinearBase
from engine.layers.norm import RMSNorm
from engine.layers.parallel import Loadable, TPContext, copy_into, materialize
from engine.layers.rotary import RotaryEmbedding
from engine.models.deepseek_moe import DeepseekMoE
from engine.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from engine.models.mla import MLAAttention, mla_rope
from engine.loading.hf_shapes import latent_width
from engine.models.moe import MoEForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """`LlamaDecoderLayer.forward` around MLA and a dense or MoE MLP."""

    def __init__(self, hf_config: Any, layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPContext, mlp: nn.Module) -> None:
        nn.Module.__init__(self)
        self.self_attn = MLAAttention(hf_config, layer_id, rotary_emb, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn.o_proj.split_sums_ok = True  # the norm after adds the partial sums
        self.mlp.split_sums_ok = True

    def quantized_input_pairs(self) -> list[tuple[nn.Module, LinearBase]]:
        # input_layernorm feeds two projections (q and the latent): no single consumer.
        if isinstance(self.mlp, LlamaMLP):
            return [(self.post_attention_layernorm, self.mlp.gate_up_proj)]
        return []


class DeepseekModel(LlamaModel):
    def __init__(self, hf_config: Any, tp: TPContext, make_mlp) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        rope = mla_rope(hf_config)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(hf_config, i, rope, tp, make_mlp(i))
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class DeepseekV2ForCausalLM(MoEForCausalLM):
    v3 = False

    def build_model(self, hf_config: Any) -> nn.Module:
        return DeepseekModel(hf_config, self.tp, self.make_mlp)

    def num_routed_experts(self) -> int:
        return self.config.n_routed_experts

    def make_mlp(self, layer_id: int) -> nn.Module:
        cfg = self.config
        freq = getattr(cfg, "moe_layer_freq", 1) or 1
        if layer_id >= (cfg.first_k_dense_replace or 0) and layer_id % freq == 0:
            return DeepseekMoE(cfg, self.tp, self.moe_parallel, cfg.n_routed_experts, self.v3)
        return LlamaMLP(cfg, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, Loadable]]) -> set[str]:
        """Attention weights go straight to their parameters (their names are HF's and
        `q_proj` is not Llama's fused one); experts, MLPs and the rest as MoE models do."""
        params = dict(self.named_parameters())
        attention: set[str] = set()

        def rest() -> Iterator[tuple[str, Loadable]]:
            for name, loaded in weights:
                layer = _LAYER.match(name)
                if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
                    continue  # V3's multi-token-prediction layers
                if ".self_attn." not in name or "rotary_emb" in name:
                    yield name, loaded
                    continue
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    copy_into(param, materialize(loaded))
                else:
                    loader(param, loaded)
                attention.add(name)

        return super().load_weights(rest()) | attention


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True
