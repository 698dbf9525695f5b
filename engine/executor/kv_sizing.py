"""How much memory a model's KV cache takes: its shape per token (`kv_shape`, `v_head_dim`),
and what another user of the same budget sets aside before the pool is sized
(`MemoryReserve`: a speculative draft model). Read by the model runner that sizes its pool
and by the draft model that reserves its share, without either importing the other."""
from __future__ import annotations

from dataclasses import dataclass

from engine.loading.hf_shapes import head_dim_of, is_mla_config, latent_width


@dataclass(frozen=True)
class MemoryReserve:
    """Device memory that sizing the KV pool from `mem_fraction_static` leaves to another
    user of the same budget (a speculative draft model): `fixed_bytes` once (its weights)
    and `bytes_per_token` per KV slot (its own pool gets as many slots as this one)."""

    fixed_bytes: int = 0
    bytes_per_token: int = 0


def kv_shape(hf_config, tp_size: int) -> tuple[int, int, int]:
    """(layers, KV heads on one rank, head dim) of a model's KV cache; for MLA (DeepSeek) one
    "head" of latent + RoPE key per token, the same on every rank, and no V (`v_head_dim`)."""
    if is_mla_config(hf_config):
        return hf_config.num_hidden_layers, 1, latent_width(hf_config)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return hf_config.num_hidden_layers, max(1, kv_heads // tp_size), head_dim_of(hf_config)


def v_head_dim(hf_config) -> int | None:
    """V's width in the pool when it is not K's: 0 for MLA's latent pool."""
    return 0 if is_mla_config(hf_config) else None
