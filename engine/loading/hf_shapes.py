"""Sizes read off a model's Hugging Face config that the model and the engine around it (the
KV pool, the attention backends) both need; plain functions of the config, so the engine
sizes a cache without importing a model."""
from __future__ import annotations

from typing import Any


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads


def attention_scale(hf_config: Any) -> float:
    """The softmax scale: 1/sqrt(head_dim), or Gemma's 1/sqrt(query_pre_attn_scalar)."""
    return (getattr(hf_config, "query_pre_attn_scalar", None) or head_dim_of(hf_config)) ** -0.5


def is_mla_config(hf_config: Any) -> bool:
    """DeepSeek's multi-head latent attention: one latent per token instead of K and V heads."""
    return getattr(hf_config, "kv_lora_rank", None) is not None


def latent_width(hf_config: Any) -> int:
    """Elements per token and layer in the latent pool: the latent and the RoPE key."""
    return hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
