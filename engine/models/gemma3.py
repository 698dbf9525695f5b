"""Gemma 3 (text): Llama's decoder with Gemma's differences.

- Layers alternate sliding-window and global attention (`layer_types`), each kind with its
  own RoPE (`rope_parameters["sliding_attention"]` / `["full_attention"]`: local base 10k,
  global base 1M, the global one possibly linearly scaled).
- Per-head RMSNorm on q and k before RoPE; softmax scale 1/sqrt(query_pre_attn_scalar).
- Four norms a layer: input, post-attention, pre-feedforward, post-feedforward (the last
  two sandwich the MLP as the first two sandwich attention).
- GeGLU MLP with the tanh GELU; embeddings multiplied by sqrt(hidden_size).
- Gemma's norms scale by (1 + w). The checkpoint's w is loaded as 1 + w into our plain
  RMSNorm, so the fused norm and RoPE kernels serve Gemma unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.attention.base import ForwardBatch
from engine.kernels.split_sums import SplitSums
from engine.layers.activation import GeluTanhAndMul
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.parallel import Loadable, TPContext, materialize
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaAttention, LlamaForCausalLM, sliding_windows
from engine.loading.hf_shapes import head_dim_of

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def layer_rope_parameters(hf_config: Any, kind: str) -> dict:
    """RoPE settings of one layer kind ("sliding_attention" or "full_attention"), as
    transformers 5 stores them; older configs' rope_theta / rope_local_base_freq /
    rope_scaling are read as transformers 4 did."""
    nested = getattr(hf_config, "rope_parameters", None) or {}
    if kind in nested:
        params = dict(nested[kind])
    elif kind == "sliding_attention":
        params = {"rope_theta": getattr(hf_config, "rope_local_base_freq", 10000.0)}
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 1_000_000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class GemmaMLP(nn.Module):
    def __init__(self, hf_config: Any, tp: TPContext) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"unsupported Gemma hidden_activation {act!r} (only gelu_pytorch_tanh)")
        inter = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hf_config.hidden_size, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, hf_config.hidden_size, False, tp)
        self.act_fn = GeluTanhAndMul()
        self.down_proj.split_sums_ok = True  # post_feedforward_layernorm adds the partial sums

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPContext) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, layer_id, rotary_emb, tp, qk_norm=True)
        self.mlp = GemmaMLP(hf_config, tp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.self_attn.o_proj.split_sums_ok = True  # post_attention_layernorm adds them

    def forward(self, positions: torch.Tensor, x: torch.Tensor | SplitSums,
                residual: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in Llama the residual is carried apart; each sublayer's output is normed on its
        # own first (the "post" norms), and that joins the residual in the next "pre" norm.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, batch))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, hf_config: Any, tp: TPContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        self.embed_scale = hf_config.hidden_size ** 0.5
        head_dim = head_dim_of(hf_config)
        kinds = ("sliding_attention", "full_attention")
        ropes = {kind: RotaryEmbedding(head_dim, hf_config.max_position_embeddings,
                                       layer_rope_parameters(hf_config, kind)) for kind in kinds}
        windows = sliding_windows(hf_config)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(hf_config, i, ropes[kinds[windows[i] is None]], tp)
            for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers rounds the scale to the model dtype before multiplying: so do we.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (1B, 270M, and the text half of 4B/12B/27B given as a text config)."""

    def __init__(self, hf_config: Any, attn_backend: Any = None, tp: TPContext | None = None) -> None:
        if getattr(hf_config, "attn_logit_softcapping", None):
            raise ValueError("attn_logit_softcapping (Gemma 2) is not supported")
        super().__init__(hf_config, attn_backend, tp)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def build_model(self, hf_config: Any) -> nn.Module:
        return Gemma3Model(hf_config, self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, Loadable]]) -> set[str]:
        return super().load_weights(_gemma_norms(weights))


def _gemma_norms(weights: Iterable[tuple[str, Loadable]]) -> Iterator[tuple[str, Loadable]]:
    """Checkpoint norm weights w -> 1 + w (in float32, as transformers adds them)."""
    for name, loaded in weights:
        if name.endswith("norm.weight"):
            loaded = 1.0 + materialize(loaded).float()
        yield name, loaded
