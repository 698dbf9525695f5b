"""Attention over the latent KV pool of multi-head latent attention (DeepSeek-V2/V3).

The pool is a `KVPool` with one "head" per token whose row is [latent c, RoPE key k_r]
(kv_lora_rank + qk_rope_head_dim) and no V half: that row is everything a token keeps, for
all heads. The model's `MLAAttention` (engine/models/mla.py) hands its projections in as
`attn` (absorb_query, expand_values, expand_kv); this module stores the new rows and attends:
- a request with one new token (decode) in the absorbed form, reading only latents: torch
  here, or the Triton kernel (engine/kernels/attention/mla_decode.py) for a whole decode step
  or a mixed step's leading decoders (`ForwardBatch.decode_rows`) at once; CUDA-graph safe
  (device lengths, fixed split count);
- a request with several (prefill, chunked prefill's later chunks, a speculative draft's
  verification) by expanding its cached latents into per-head K and V.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.attention.base import ForwardBatch
from engine.attention.kv_pool import KVPool
from engine.attention.torch_backend import attend

EXTEND_QUERY_BLOCK = 512  # [16 heads, 512, 8k keys] float32 scores: 256 MiB


class MLABackend:
    """`forward_mla(q_nope, q_rope, latent, k_rope, attn, batch)` -> [T, H, v_head_dim]."""

    supports_sliding_window = False

    def __init__(self, kv_pool: KVPool, kv_lora_rank: int, triton_decode: bool = False,
                 graph_mode: bool = False) -> None:
        self.kv_pool = kv_pool
        self.kv_lora_rank = kv_lora_rank
        self.triton_decode = triton_decode
        self.graph_mode = graph_mode  # decode splits sized by the context limit, not the step
        # The torch extend path loops over requests on the host: not capturable.
        self.supports_extend_graphs = False

    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TypeError("an MLA model attends through forward_mla (engine/models/mla.py)")

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    k_rope: torch.Tensor, attn: Any, batch: ForwardBatch) -> torch.Tensor:
        pool = self.kv_pool
        cache = pool.k[attn.layer_id]
        cache[batch.out_slots, 0] = pool.encode(torch.cat([latent, k_rope], dim=-1))
        decoders = batch.batch_size if batch.is_decode else batch.decode_rows
        decoders = decoders if self.triton_decode else 0
        if decoders == batch.batch_size:
            return self._decode_triton(q_nope, q_rope, cache, attn, batch, decoders)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], attn.v_dim)
        if decoders:  # one token each, first in the step
            out[:decoders] = self._decode_triton(q_nope[:decoders], q_rope[:decoders], cache,
                                                 attn, batch, decoders)
        start = decoders
        for i in range(decoders, batch.batch_size):
            seq_len, n_new = batch.seq_lens_cpu[i], batch.extend_lens_cpu[i]
            slots = batch.req_to_token[batch.req_rows[i], :seq_len].long()
            rows = pool.decode(cache[slots, 0], q_nope.dtype)
            c, k_r = rows[:, :self.kv_lora_rank], rows[:, self.kv_lora_rank:]
            span = slice(start, start + n_new)
            if n_new == 1:
                out[span] = self._decode_one(q_nope[span], q_rope[span], c, k_r, attn)
            else:
                out[span] = self._extend_one(q_nope[span], q_rope[span], c, k_r, attn,
                                             seq_len - n_new)
            start += n_new
        return out

    @staticmethod
    def _decode_one(q_nope: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor,
                    k_r: torch.Tensor, attn: Any) -> torch.Tensor:
        """One token's heads against S cached latents, absorbed: [1, H, v]."""
        q_lat = attn.absorb_query(q_nope)[0]  # [H, C]
        logits = (q_lat.float() @ c.float().T + q_rope[0].float() @ k_r.float().T) * attn.scale
        probs = torch.softmax(logits, dim=-1)  # [H, S]
        latent_out = (probs @ c.float()).to(q_nope.dtype)  # [H, C]
        return attn.expand_values(latent_out.unsqueeze(0))

    @staticmethod
    def _extend_one(q_nope: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor,
                    k_r: torch.Tensor, attn: Any, prefix_len: int) -> torch.Tensor:
        """n new tokens against their request's S cached latents, expanded: [n, H, v]."""
        k_nope, v = attn.expand_kv(c)  # [S, H, nope], [S, H, v]
        heads = k_nope.shape[1]
        k = torch.cat([k_nope, k_r.unsqueeze(1).expand(-1, heads, -1)], dim=-1).transpose(0, 1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        v = v.transpose(0, 1)
        # Blocks of queries, so the masked attention's [H, block, S] scores stay small: a
        # long prompt's whole [H, n, S] would not fit beside a full KV pool.
        out = q_nope.new_empty(q_nope.shape[0], heads, v.shape[-1])
        for lo in range(0, q.shape[1], EXTEND_QUERY_BLOCK):
            hi = min(lo + EXTEND_QUERY_BLOCK, q.shape[1])
            keys = prefix_len + hi
            out[lo:hi] = attend(q[:, lo:hi], k[:, :keys], v[:, :keys], prefix_len + lo,
                                attn.scale).transpose(0, 1)
        return out

    def _decode_triton(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                       attn: Any, batch: ForwardBatch, n: int) -> torch.Tensor:
        """The first `n` requests of the step, one new token each."""
        from engine.kernels.attention.mla_decode import mla_decode

        if self.graph_mode and batch.is_decode:  # (a captured step: lengths change on replay)
            max_len = batch.req_to_token.shape[1]
        else:
            max_len = max(batch.seq_lens_cpu[:n])
        latent_out = mla_decode(attn.absorb_query(q_nope), q_rope, cache, batch.req_to_token,
                                batch.req_rows[:n], batch.seq_lens[:n], attn.scale,
                                self.kv_lora_rank, max_len,
                                kv_scale=self.kv_pool.scale if self.kv_pool.fp8 else 1.0)
        return attn.expand_values(latent_out)
