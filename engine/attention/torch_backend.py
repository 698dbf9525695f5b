"""Pure-torch attention: the CPU path and the oracle the GPU kernels are checked against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import ForwardBatch
from engine.attention.kv_pool import KVPool


class TorchAttentionBackend:
    """Gathers each request's K/V by slot index, then runs causal SDPA with the right offset.
    Layers given a sliding window (`set_sliding_windows`) attend to their last `window`
    tokens only, as transformers' Mistral/Qwen2 masks do."""

    supports_sliding_window = True

    def __init__(self, kv_pool: KVPool, scale: float) -> None:
        self.kv_pool = kv_pool
        self.scale = scale
        self.windows: dict[int, int] = {}  # layer id -> window (tokens a query sees, itself included)

    def set_sliding_windows(self, windows: dict[int, int]) -> None:
        self.windows = dict(windows)

    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool = self.kv_pool
        k_cache, v_cache = pool.k[layer_id], pool.v[layer_id]
        k_cache[batch.out_slots] = pool.encode(k)
        v_cache[batch.out_slots] = pool.encode(v)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        window = self.windows.get(layer_id)
        start = 0
        for i, (seq_len, n_new) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            # Keys before the first new token's window are seen by no query: not gathered.
            first = 0 if window is None else max(0, seq_len - n_new - window + 1)
            slots = batch.req_to_token[batch.req_rows[i], first:seq_len].long()
            qi = q[start:start + n_new].transpose(0, 1)  # [Hq, n_new, D]
            ki = pool.decode(k_cache[slots], q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            vi = pool.decode(v_cache[slots], q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            out[start:start + n_new] = attend(qi, ki, vi, seq_len - n_new - first, self.scale,
                                              window).transpose(0, 1)
            start += n_new
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
           scale: float, window: int | None = None) -> torch.Tensor:
    """q [H, n, D] against k, v [H, prefix_len + n, D]; query j sees keys 0..prefix_len+j,
    and with a window only the last `window` of those (keys > prefix_len + j - window)."""
    n, s = q.shape[1], k.shape[1]
    if n == 1 and (window is None or s <= window):
        mask = None
    else:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + prefix_len
        keys = torch.arange(s, device=q.device).unsqueeze(0)
        mask = keys <= rows
        if window is not None:
            mask &= keys > rows - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
