"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's decoder with fused checkpoint weights (`qkv_proj`,
`gate_up_proj`, split here into q/k/v and gate/up so every TP rank loads its own heads and
columns), partial rotary (Phi-4-mini rotates 3/4 of each head) and LongRoPE for the 128k
variants (engine/layers/longrope.py: the short or long factors by each request's length)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.attention.base import ForwardBatch
from engine.layers.longrope import LongRopeEmbedding
from engine.layers.parallel import Loadable, TPContext, materialize
from engine.layers.rotary import rope_parameters
from engine.models.llama import LlamaForCausalLM, LlamaModel
from engine.loading.hf_shapes import head_dim_of


class Phi3Model(LlamaModel):
    def __init__(self, hf_config: Any, tp: TPContext) -> None:
        params = rope_parameters(hf_config)
        longrope = None
        if params["rope_type"] == "longrope":
            params.setdefault("original_max_position_embeddings",
                              getattr(hf_config, "original_max_position_embeddings", None))
            head_dim = head_dim_of(hf_config)
            longrope = LongRopeEmbedding(head_dim, hf_config.max_position_embeddings, params,
                                         int(head_dim * params.get("partial_rotary_factor", 1.0)))
        super().__init__(hf_config, tp, rotary_emb=longrope)
        self.longrope = longrope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        if self.longrope is not None:  # the positions reach only RoPE: rows of its two-set cache
            positions = self.longrope.rope_positions(positions, batch.seq_lens, batch.extend_lens)
        return super().forward(input_ids, positions, batch)


class Phi3ForCausalLM(LlamaForCausalLM):
    def build_model(self, hf_config: Any) -> nn.Module:
        return Phi3Model(hf_config, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, Loadable]]) -> set[str]:
        return super().load_weights(split_fused(weights, self.config))


def split_fused(weights: Iterable[tuple[str, Loadable]], hf_config: Any
                ) -> Iterator[tuple[str, Loadable]]:
    """Phi-3's fused `qkv_proj` / `gate_up_proj` tensors as the separate q/k/v and gate/up
    ones Llama checkpoints hold (rows: q heads, k heads, v heads; gate, up)."""
    head_dim = head_dim_of(hf_config)
    q_rows = hf_config.num_attention_heads * head_dim
    kv_rows = (getattr(hf_config, "num_key_value_heads", None)
               or hf_config.num_attention_heads) * head_dim
    for name, loaded in weights:
        if ".qkv_proj." in name:
            parts = materialize(loaded).split([q_rows, kv_rows, kv_rows])
            yield from ((name.replace(".qkv_proj.", f".{p}_proj."), t) for p, t in zip("qkv", parts))
        elif ".gate_up_proj." in name:
            gate, up = materialize(loaded).chunk(2)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, loaded
