"""Multi-head latent attention (DeepSeek-V2/V3): the projections around the latent cache.

Each token's keys and values are compressed into one latent c (kv_lora_rank wide, after
`kv_a_layernorm`) plus one RoPE key k_r (qk_rope_head_dim wide) shared by every head; the
KV pool stores just [c, k_r] per token and layer (engine/attention/mla_backend.py).
`kv_b_proj` expands c into each head's no-RoPE key and its value:
k_h = [W_UK_h c, k_r], v_h = W_UV_h c.
- Prefill/extend expands the cached latents into K and V and attends as usual.
- Decode absorbs W_UK into the query (q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_r)
  and W_UV into the output (sum_j p_j v_hj = W_UV_h sum_j p_j c_j), so it reads only the
  latents: one row per token for all heads.

The RoPE half is rotated in DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...: q and k
are permuted to the rotate-half layout first (both alike, so their dot is unchanged), which
is what transformers' V3 does; V2's complex form gives the same products.
Softmax scale: 1/sqrt(qk_nope + qk_rope) times YaRN's mscale(factor, mscale_all_dim)^2.
TP splits the heads (q_b_proj / q_proj, kv_b_proj by rows, o_proj by columns); the
latent projection and the pool are the same on every rank.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.attention.base import ForwardBatch
from engine.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.layers.parallel import TPContext, divide
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.loading.hf_shapes import latent_width

_LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not rms_norm_eps


def mla_softmax_scale(hf_config: Any) -> float:
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    m_all = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and m_all and float(params["factor"]) > 1:
        mscale = 0.1 * float(m_all) * math.log(float(params["factor"])) + 1.0
        scale *= mscale * mscale
    return scale


def mla_rope(hf_config: Any) -> RotaryEmbedding:
    params = rope_parameters(hf_config)
    return RotaryEmbedding(hf_config.qk_rope_head_dim, hf_config.max_position_embeddings, params)


def rope_interleaved(hf_config: Any) -> bool:
    if getattr(hf_config, "model_type", "") == "deepseek_v2":
        return True
    return bool(getattr(hf_config, "rope_interleave", True))


class MLAAttention(nn.Module):
    def __init__(self, hf_config: Any, layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPContext) -> None:
        super().__init__()
        self.layer_id = layer_id
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.num_heads = divide(heads, tp.size, "number of attention heads")
        self.nope_dim, self.rope_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = hf_config.v_head_dim, hf_config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, tp)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, False, tp)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, False, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias, tp)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              heads * (self.nope_dim + self.v_dim), False, tp)
        self.kv_b_proj.keep_dtype = True  # decode reads its weight as the absorbed matrices
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, tp)
        self.rotary_emb = rotary_emb
        self.interleaved = rope_interleaved(hf_config)
        self.scale = mla_softmax_scale(hf_config)
        # The pool's shape (what the model runner reads): one "head" of latent + RoPE key.
        self.head_dim, self.num_kv_heads = latent_width(hf_config), 1
        self.attn_backend = None  # an MLA backend, set by the model

    # -- the latent <-> per-head maps (the backend calls these) ---------------------------

    def _kv_b(self) -> torch.Tensor:
        """kv_b_proj's weight as [heads, nope + v, kv_lora_rank]."""
        return self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                          self.kv_lora_rank)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, kv_lora_rank]: W_UK_h^T q_nope_h."""
        w_uk = self._kv_b()[:, :self.nope_dim]
        return torch.einsum("thn,hnc->thc", q_nope, w_uk)

    def expand_values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[T, H, kv_lora_rank] -> [T, H, v]: W_UV_h applied to an attention-weighted latent."""
        w_uv = self._kv_b()[:, self.nope_dim:]
        return torch.einsum("thc,hvc->thv", latent_out, w_uv)

    def expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents [S, kv_lora_rank] -> no-RoPE keys [S, H, nope], values [S, H, v]."""
        kv = self.kv_b_proj(latent)
        kv = kv.view(-1, self.num_heads, self.nope_dim + self.v_dim)
        return kv[..., :self.nope_dim], kv[..., self.nope_dim:]

    # -- forward ------------------------------------------------------------------------

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def _to_half_layout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.interleaved:
            return x.contiguous()
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self._queries(x).view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary_emb(positions, self._to_half_layout(q_rope),
                                         self._to_half_layout(k_rope).unsqueeze(1))
        out = self.attn_backend.forward_mla(q_nope, q_rope, latent, k_rope.squeeze(1), self, batch)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))
