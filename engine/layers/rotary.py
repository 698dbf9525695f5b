"""Rotary position embedding (GPT-NeoX "rotate half" layout, as HF Llama/Qwen).

cos/sin for every position up to `max_position` are precomputed once in float32; a step
gathers the rows of its tokens' positions, so ragged batches need no per-request work.
Scaled variants change only the cache (frequencies, and YaRN's attention factor folded into
cos and sin), so the torch path and the fused Triton kernel both apply them unchanged.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kernels.split_sums import SplitSums

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict:
    """The config's RoPE settings as one dict with `rope_type` and `rope_theta`.

    transformers 5 keeps them in `rope_parameters`; older configs in `rope_scaling` (None
    for plain RoPE) plus a top-level `rope_theta`.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn"):
        # As transformers: a top-level value (Phi-3 style configs) wins over the dict's.
        top_level = getattr(hf_config, "original_max_position_embeddings", None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    if params["rope_type"] == "yarn" and params.get("factor") is None:
        # DeepSeek-V3 style: the factor is implied by the two lengths.
        params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


def inverse_frequencies(rotary_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, params)
    if kind == "yarn":
        return _yarn_scale(inv_freq, rotary_dim, params)
    raise NotImplementedError(f"rope_type {kind!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 long-context scaling: long wavelengths are slowed by `factor`, short ones
    kept, and the band in between interpolated smoothly."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_scale(inv_freq: torch.Tensor, rotary_dim: int, params: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than
    `beta_fast` times are kept (extrapolated), with a linear ramp over the dimensions between."""
    base, factor = float(params["rope_theta"]), float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_turning(turns: float) -> float:
        # The (fractional) pair index whose wavelength fits `turns` times into old_len.
        return rotary_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 for the fast dimensions (kept), 0 for the slow ones (interpolated)
    # Evaluated in transformers' order, so the cache is bit-equal to theirs.
    wavelength_over_2pi = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    interpolated = 1.0 / (factor * wavelength_over_2pi)
    return interpolated * (1 - keep) + inv_freq * keep


def attention_factor(params: dict) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's "mscale", which keeps the
    attention logits' temperature steady as the context grows."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:  # DeepSeek style: a ratio of the two
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def cache_positions(params: dict, max_position: int) -> int:
    """Positions the cos/sin cache covers. A YaRN config may keep `max_position_embeddings`
    at the original length (Qwen's recipe adds only `rope_scaling`) while the scaled context
    is factor times longer, so the cache covers that too."""
    if params["rope_type"] != "yarn":
        return max_position
    return max(max_position, int(params["original_max_position_embeddings"] * float(params["factor"])))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = inverse_frequencies(self.rotary_dim, params)
        freqs = torch.outer(torch.arange(cache_positions(params, max_position),
                                         dtype=torch.float32), inv_freq)
        # [positions, rotary_dim]: cos in the first half, sin in the second.
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor(params)
        self.register_buffer("cos_sin_cache", cache.to(device=torch.get_default_device()),
                             persistent=False)
        self.fused = False  # one Triton kernel on GPUs (engine/kernels/fused.py)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                norms: tuple[nn.Module, nn.Module] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by their tokens' positions [T]; with `norms`
        (per-head RMSNorms of q and of k, Qwen3) normalised first."""
        if self.fused and q.is_cuda and self.rotary_dim == self.head_dim:
            from engine.kernels.fused import rope

            return rope(positions, q, k, self.cos_sin_cache, _qk_norm(norms))
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)  # [T, 1, rd/2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def forward_split_sums(self, positions: torch.Tensor, qkv: SplitSums, heads: tuple[int, int, int],
                           norms: tuple[nn.Module, nn.Module] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) of a qkv projection left as partial sums (engine/kernels/split_sums.py),
        `heads` = (Hq, Hkv, D): q and k rotated as `forward` does, the sums added in the
        same launch when it is fused."""
        hq, hkv, d = heads
        if self.fused and qkv.is_cuda and self.rotary_dim == self.head_dim:
            from engine.kernels.fused import rope_split_sums

            return rope_split_sums(positions, qkv, heads, self.cos_sin_cache, _qk_norm(norms))
        q, k, v = qkv.total().split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = self.forward(positions, q.view(-1, hq, d), k.view(-1, hkv, d), norms)
        return q, k, v.view(-1, hkv, d)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def _qk_norm(norms: tuple[nn.Module, nn.Module] | None
             ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The fused kernel's form of Qwen3's per-head norms: (q weight, k weight, eps)."""
    if norms is None:
        return None
    q_norm, k_norm = norms
    assert q_norm.eps == k_norm.eps  # the kernel takes one
    return q_norm.weight, k_norm.weight, q_norm.eps


def get_rope(hf_config: Any, head_dim: int) -> RotaryEmbedding:
    params = rope_parameters(hf_config)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, params, rotary_dim)
