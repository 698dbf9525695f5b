"""LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): two sets of per-dimension RoPE rescale
factors, `short_factor` and `long_factor`, and a cos/sin scale sqrt(1 + ln(s)/ln(L0)) for
the context extension s = max_position_embeddings / L0 (L0: the pretraining context,
`original_max_position_embeddings`).

Choosing the set by length, as transformers does: a forward uses the long factors when the
sequence it runs on reaches past L0 (its largest position + 1 > L0), the short ones
otherwise. Here the rule is applied per request of a step: a request whose KV holds more
than L0 tokens after this step runs its new tokens with the long factors. So a prompt
longer than L0 is rotated as transformers rotates it, and so is one within L0 while it stays
within. Where a request grows past L0 while decoding, transformers' Phi-3 drops its cache and
recomputes the whole sequence with the long factors; here (as in vLLM) the keys already
cached keep the short rotation. A radix-cache prefix is reused whichever set it was stored
with. The cache holds both sets, short rows then long
rows, and `rope_positions` moves a long request's positions into the long half, so the
rotary kernels (torch and the fused Triton one) read it as a plain cos/sin cache.
"""
from __future__ import annotations

import math

import torch

from engine.layers.rotary import RotaryEmbedding


def longrope_attention_factor(params: dict, max_position: int) -> float:
    original = float(params["original_max_position_embeddings"])
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or max_position / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class LongRopeEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_position: int, params: dict, rotary_dim: int) -> None:
        # The parent's cache is plain RoPE at this base: replaced below by the two sets.
        super().__init__(head_dim, 1, {"rope_type": "default", "rope_theta": params["rope_theta"]},
                         rotary_dim)
        self.original_max_position = int(params["original_max_position_embeddings"])
        self.max_position = max_position
        scale = longrope_attention_factor(params, max_position)
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        halves = []
        for key in ("short_factor", "long_factor"):
            ext = torch.tensor(params[key], dtype=torch.float32)
            if ext.numel() != rotary_dim // 2:
                raise ValueError(f"LongRoPE {key} has {ext.numel()} entries, expected {rotary_dim // 2}")
            inv_freq = 1.0 / (ext * float(params["rope_theta"]) ** exponents)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            halves.append(torch.cat((freqs.cos(), freqs.sin()), dim=-1) * scale)
        self.cos_sin_cache = torch.cat(halves).to(device=torch.get_default_device())

    def rope_positions(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                       extend_lens: torch.Tensor) -> torch.Tensor:
        """Cache rows of a step's tokens: its positions, moved into the long half for the
        requests (seq_lens, extend_lens: per request) longer than the pretraining context.
        Device ops only (no host sync), so it runs inside captured CUDA graphs."""
        long = (seq_lens > self.original_max_position).to(positions.dtype) * self.max_position
        # A captured decode graph pads its tokens past the live requests' (whose extend_lens
        # then sum to less): one more zero entry covers the padding, so the lengths always
        # sum to the token count that `output_size` promises.
        lens = extend_lens.long()
        total = positions.shape[0]
        lens = torch.cat([lens, (total - lens.sum()).clamp(min=0).reshape(1)])
        long = torch.cat([long, long.new_zeros(1)])
        return positions + torch.repeat_interleave(long, lens, output_size=total)
