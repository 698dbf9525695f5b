"""Absorbed-weight MLA decode over the latent pool (DeepSeek-V2/V3; engine/attention/mla_backend.py).

Every head of a token attends over the same cached rows [latent c (C wide), RoPE key k_r
(R wide)], so a program takes BLOCK_H heads of one request and one split of its keys: each
latent tile is loaded once for all of them (the point of MLA: C + R elements a token, not
2 x heads x head_dim). Per split it writes the heads' normalised latent output and their
log-sum-exp (base 2); the GQA decode's reduce kernel (decode.py) merges the splits, which
are cut as it cuts them: each request's length over the split count, in whole BLOCK_N tiles.
Lengths come from the device (`SeqLens`) and the split count from the host's bound, so a
CUDA graph replays it for any lengths up to that bound.
Conventions (slot widening to int64, F32_DOT, base-2 softmax): common.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention.common import dot, pv_dot
from engine.kernels.attention.decode import decode_reduce_kernel
from engine.kernels.launch import pdl_launch, pdl_prologue

_LOG2E = 1.4426950408889634  # softmax in base 2, as common.py's kernels


@triton.jit
def _mla_decode_kernel(QLat, QRope, Cache, ReqToToken, ReqRows, SeqLens, Out, Lse,
                       stride_qb, stride_qh, stride_rb, stride_rh, stride_c, stride_rt,
                       stride_ob, stride_oh, stride_os, num_heads, scale_log2,
                       kv_scale,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, KV_FP8: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < num_heads
    seq_len = tl.load(SeqLens + b)
    row = tl.load(ReqRows + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    q_lat = tl.load(QLat + b * stride_qb + heads[:, None] * stride_qh + offs_c[None, :],
                    mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(QRope + b * stride_rb + heads[:, None] * stride_rh + offs_r[None, :],
                     mask=head_ok[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=n_ok, other=0).to(tl.int64)
        c = tl.load(Cache + slots[:, None] * stride_c + offs_c[None, :], mask=n_ok[:, None], other=0.0)
        k_r = tl.load(Cache + slots[:, None] * stride_c + C + offs_r[None, :], mask=n_ok[:, None],
                      other=0.0)
        if KV_FP8:
            c = (c.to(tl.float32) * kv_scale).to(tl.float16)
            k_r = (k_r.to(tl.float32) * kv_scale).to(tl.float16)
        logits = dot(q_lat.to(c.dtype), tl.trans(c), F32_DOT)
        logits += dot(q_rope.to(k_r.dtype), tl.trans(k_r), F32_DOT)
        logits = tl.where(n_ok[None, :], logits * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + pv_dot(p, c, F32_DOT)
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    base = b * stride_ob + heads * stride_oh + split * stride_os
    tl.store(Out + base[:, None] + offs_c[None, :], out, mask=head_ok[:, None])
    tl.store(Lse + (b * num_heads + heads) * tl.num_programs(2) + split, lse, mask=head_ok)


MAX_SPLITS = 16  # the reduce holds a request's splits x C partials in registers


def num_splits(batch: int, head_blocks: int, max_len: int, block_n: int) -> int:
    """Enough programs to fill the GPU (about 2 per SM of 132) without splits shorter than
    4 tiles; at most MAX_SPLITS (at batch 1 the latents are a small part of a step's reads)."""
    want = max(1, -(-264 // max(1, batch * head_blocks)))
    return max(1, min(want, MAX_SPLITS, -(-max_len // (4 * block_n))))


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
               req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, kv_lora_rank: int, max_len: int, kv_scale: float = 1.0,
               block_h: int = 16, block_n: int = 32) -> torch.Tensor:
    """q_lat [B, H, C] (queries absorbed through W_UK), q_rope [B, H, R] against each
    request's cached rows of `cache` [slots + 1, 1, C + R]; returns the attention-weighted
    latents [B, H, C] in q_lat's dtype. `max_len` bounds every request's length."""
    b, h, c = q_lat.shape
    r = q_rope.shape[-1]
    assert c == kv_lora_rank and cache.shape[-1] == c + r
    assert c == triton.next_power_of_2(c) and r == triton.next_power_of_2(r) and r >= 16
    head_blocks = triton.cdiv(h, block_h)
    splits = num_splits(b, head_blocks, max_len, block_n)
    mid = torch.empty((b, h, splits, c), dtype=torch.float32, device=q_lat.device)
    lse = torch.empty((b, h, splits), dtype=torch.float32, device=q_lat.device)
    out = torch.empty((b, h, c), dtype=q_lat.dtype, device=q_lat.device)
    cache2d = cache.view(cache.shape[0], -1)
    fp8 = cache.dtype == torch.float8_e4m3fn
    pdl = pdl_launch(q_lat.device)
    _mla_decode_kernel[(b, head_blocks, splits)](
        q_lat, q_rope, cache2d, req_to_token, req_rows, seq_lens, mid, lse,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache2d.stride(0),
        req_to_token.stride(0), mid.stride(0), mid.stride(1), mid.stride(2), h,
        scale * _LOG2E, kv_scale, C=c, R=r, BLOCK_H=block_h, BLOCK_N=block_n,
        F32_DOT=q_lat.dtype == torch.float32, KV_FP8=fp8, num_warps=4, num_stages=2, **pdl)
    unused = (seq_lens, out, out, seq_lens)  # the reduce's prefix-group inputs: none here
    decode_reduce_kernel[(h, b)](
        mid, lse, seq_lens, out, splits, mid.stride(0), mid.stride(1), mid.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), *unused, seq_lens, seq_lens,
        0, 0, 0, 0, 0, 0, BLOCK_N=block_n, HEAD_DIM=c, BLOCK_D=c,
        BLOCK_S=triton.next_power_of_2(splits), num_warps=4, **pdl)
    return out
