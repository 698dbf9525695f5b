"""Pure-torch attention: the CPU path and the oracle the GPU kernels are checked against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import ForwardBatch
from engine.kv_pool import KVPool


class TorchAttentionBackend:
    """Gathers each request's K/V by slot index, then runs causal SDPA with the right offset."""

    def __init__(self, kv_pool: KVPool, scale: float) -> None:
        self.kv_pool = kv_pool
        self.scale = scale

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
        start = 0
        for i, (seq_len, n_new) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            slots = batch.req_to_token[batch.req_rows[i], :seq_len].long()
            qi = q[start:start + n_new].transpose(0, 1)  # [Hq, n_new, D]
            ki = pool.decode(k_cache[slots], q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            vi = pool.decode(v_cache[slots], q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            out[start:start + n_new] = attend(qi, ki, vi, seq_len - n_new, self.scale).transpose(0, 1)
            start += n_new
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
           scale: float) -> torch.Tensor:
    """q [H, n, D] against k, v [H, prefix_len + n, D]; query j sees keys 0..prefix_len+j."""
    n, s = q.shape[1], k.shape[1]
    if n == 1:
        mask = None
    else:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + prefix_len
        mask = torch.arange(s, device=q.device).unsqueeze(0) <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
