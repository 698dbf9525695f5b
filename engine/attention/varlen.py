"""Attention over a packed batch with no KV cache: the pooling tasks' one forward.

Many short inputs are packed into one ragged batch of T tokens (no padding in the linears,
which hold almost all of the FLOPs); only attention sees them as a [B, Lmax] grid, with a
mask that keeps each sequence to itself. The pooling engine sorts inputs by length before
packing, so the grid's padding stays small."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import ForwardBatch


@dataclass
class PackedLayout:
    """Where each packed token sits in the [B, Lmax] grid attention runs on, and the mask;
    made once per forward and shared by every layer (its `nonzero` syncs with the device)."""

    lens: list[int]
    index: torch.Tensor  # [T]: each token's place in the flattened grid
    mask: torch.Tensor  # [B, 1, Lmax|1, Lmax] bool: which keys each query sees

    @classmethod
    def of(cls, lens: list[int], causal: bool, device: torch.device) -> PackedLayout:
        lmax = max(lens)
        lens_t = torch.tensor(lens, device=device)
        valid = torch.arange(lmax, device=device)[None, :] < lens_t[:, None]
        mask = valid[:, None, None, :]  # other sequences' keys and padding are never seen
        if causal:
            mask = mask & torch.ones(lmax, lmax, dtype=torch.bool, device=device).tril()
        return cls(list(lens), valid.flatten().nonzero().squeeze(1), mask)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                     causal: bool, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] of sequences of `layout.lens` tokens, back to back
    -> [T, Hq, D]; each token attends within its own sequence (causally when `causal`)."""
    if len(layout.lens) == 1:
        return _dense(q, k, v, causal, scale)
    b, lmax = len(layout.lens), max(layout.lens)
    qg, kg, vg = (_to_grid(x, layout.index, b, lmax) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=layout.mask, scale=scale,
                                         enable_gqa=group > 1)
    return out.transpose(1, 2).reshape(b * lmax, q.shape[1], q.shape[2])[layout.index]


def packed_positions(lens: list[int], device: torch.device) -> torch.Tensor:
    """[T]: each packed token's position in its own sequence (0, 1, ..., 0, 1, ...)."""
    lens_t = torch.tensor(lens, device=device)
    starts = lens_t.cumsum(0) - lens_t
    return torch.arange(int(sum(lens)), device=device) - starts.repeat_interleave(lens_t)


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
        self._batch: ForwardBatch | None = None
        self._layout: PackedLayout | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        self._batch, self._layout = batch, PackedLayout.of(batch.extend_lens_cpu, True,
                                                           batch.input_ids.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if batch is not self._batch:
            self.prepare(batch)
        return varlen_attention(q, k, v, self._layout, True, self.scale)


def packed_batch(input_ids: torch.Tensor, lens: list[int], max_context: int) -> ForwardBatch:
    """A ForwardBatch for `PackedCausalBackend`: positions restart at 0 per sequence; the
    KV fields are empty (nothing reads them)."""
    device = input_ids.device
    lens_t = torch.tensor(lens, device=device)
    positions = packed_positions(lens, device)
    indptr = torch.tensor([0] + lens, device=device, dtype=torch.int32).cumsum(0).to(torch.int32)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_slots=empty, req_rows=empty,
        seq_lens=lens_t.to(torch.int32), extend_lens=lens_t.to(torch.int32), qo_indptr=indptr,
        logits_indices=indptr[1:].long() - 1,
        req_to_token=torch.empty((0, max_context), dtype=torch.int32, device=device),
        is_decode=False, seq_lens_cpu=list(lens), extend_lens_cpu=list(lens))
