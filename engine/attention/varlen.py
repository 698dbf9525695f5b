"""Attention over a packed batch with no KV cache: the pooling tasks' one forward.

Many short inputs are packed into one ragged batch of T tokens (no padding in the linears,
which hold almost all of the FLOPs); only attention sees them as a [B, Lmax] grid, with a
mask that keeps each sequence to itself. The pooling engine sorts inputs by length before
packing, so the grid's padding stays small."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import ForwardBatch


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                     causal: bool, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] of sequences of `lens` tokens, back to back ->
    [T, Hq, D]; each token attends within its own sequence (causally when `causal`)."""
    if len(lens) == 1:
        return _dense(q, k, v, causal, scale)
    index, valid = grid_index(lens, q.device)
    b, lmax = valid.shape
    qg, kg, vg = (_to_grid(x, index, b, lmax) for x in (q, k, v))
    mask = valid[:, None, None, :]  # keys of other sequences and padding are never seen
    if causal:
        mask = mask & torch.ones(lmax, lmax, dtype=torch.bool, device=q.device).tril()
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                         enable_gqa=group > 1)
    return out.transpose(1, 2).reshape(b * lmax, q.shape[1], q.shape[2])[index]


def grid_index(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [T] of each packed token in the flattened [B, Lmax] grid, valid [B, Lmax])."""
    lmax = max(lens)
    lens_t = torch.tensor(lens, device=device)
    valid = torch.arange(lmax, device=device)[None, :] < lens_t[:, None]
    return valid.flatten().nonzero().squeeze(1), valid


def _to_grid(x: torch.Tensor, index: torch.Tensor, b: int, lmax: int) -> torch.Tensor:
    grid = x.new_zeros(b * lmax, x.shape[1], x.shape[2])
    grid[index] = x
    return grid.view(b, lmax, x.shape[1], x.shape[2]).transpose(1, 2)  # [B, H, Lmax, D]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=causal, scale=scale, enable_gqa=group > 1)
    return out.transpose(0, 1)


class PackedCausalBackend:
    """The attention backend a decoder model (the Llama/Qwen paths) runs under when it is an
    embedder: causal attention within each packed sequence of `batch.extend_lens_cpu`, no
    KV written anywhere (nothing is decoded after the one forward)."""

    supports_sliding_window = False

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        return varlen_attention(q, k, v, batch.extend_lens_cpu, True, self.scale)


def packed_batch(input_ids: torch.Tensor, lens: list[int], max_context: int) -> ForwardBatch:
    """A ForwardBatch for `PackedCausalBackend`: positions restart at 0 per sequence; the
    KV fields are empty (nothing reads them)."""
    device = input_ids.device
    starts = torch.tensor([0] + lens[:-1], device=device).cumsum(0)
    lens_t = torch.tensor(lens, device=device)
    positions = torch.arange(input_ids.shape[0], device=device) - starts.repeat_interleave(lens_t)
    indptr = torch.tensor([0] + lens, device=device, dtype=torch.int32).cumsum(0).to(torch.int32)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_slots=empty, req_rows=empty,
        seq_lens=lens_t.to(torch.int32), extend_lens=lens_t.to(torch.int32), qo_indptr=indptr,
        logits_indices=indptr[1:].long() - 1,
        req_to_token=torch.empty((0, max_context), dtype=torch.int32, device=device),
        is_decode=False, seq_lens_cpu=list(lens), extend_lens_cpu=list(lens))
